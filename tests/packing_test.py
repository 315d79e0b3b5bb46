"""Packing stage pytrees of different structures into flat buffers."""

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import packing


def _trees():
  return [
      {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(7)},
      {"a": np.ones(4, jnp.bfloat16), "b": (np.full(5, 2.0, np.float32),)},
      {},
  ]


def test_round_trip_keeps_values_shapes_and_dtypes():
  trees = _trees()
  layout = packing.Packing(trees)
  back = layout.unpack_all(layout.pack_all(trees))
  for tree, got in zip(trees, back):
    assert jax.tree.structure(tree) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(got)):
      assert np.asarray(a).dtype == np.asarray(b).dtype
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))


def test_buffers_are_padded_to_the_longest_stage():
  layout = packing.Packing(_trees())
  flat = layout.pack_all(_trees())
  assert flat["float32"].shape == (3, 6)  # stage 0: 6 floats; stage 1: 5
  assert flat["bfloat16"].shape == (3, 4)
  assert flat["int32"].shape == (3, 1)
  np.testing.assert_array_equal(flat["float32"][1], [2, 2, 2, 2, 2, 0])
  np.testing.assert_array_equal(flat["float32"][2], np.zeros(6))


def test_pack_is_traceable():
  trees = _trees()
  layout = packing.Packing(trees)
  flat = jax.jit(lambda t: layout.pack(0, t))(trees[0])
  np.testing.assert_array_equal(flat["float32"], np.arange(6))
