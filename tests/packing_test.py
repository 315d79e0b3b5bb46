"""Packing stage pytrees of different structures into flat buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def _uniform_trees():
  rng = np.random.default_rng(0)
  return [{"w": rng.normal(size=(3, 2)).astype(np.float32),
           "b": (rng.normal(size=2).astype(np.float32), np.int32(s))}
          for s in range(3)]


def test_stacking_keeps_each_leaf_in_its_shape_and_round_trips():
  trees = _uniform_trees()
  layout = packing.Stacking(trees)
  flat = layout.pack_all(trees)
  # One [S, *shape] array per leaf, in jax.tree.leaves order.
  leaves = [np.stack(v) for v in zip(*[jax.tree.leaves(t) for t in trees])]
  assert [flat[k].shape for k in sorted(flat)] == [v.shape for v in leaves]
  for k, v in zip(sorted(flat), leaves):
    np.testing.assert_array_equal(flat[k], v)
  for tree, got in zip(trees, layout.unpack_all(flat)):
    assert jax.tree.structure(tree) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(got)):
      np.testing.assert_array_equal(a, b)
  assert layout.row_bytes == sum(np.asarray(v).nbytes
                                 for v in jax.tree.leaves(trees[0]))


def test_stacking_refuses_stages_of_different_structures_in_one_line():
  trees = _uniform_trees()
  trees[2] = {"w": np.zeros((3, 4), np.float32), "b": trees[2]["b"]}
  try:
    packing.Stacking(trees)
  except ValueError as e:
    assert "stage 2" in str(e) and "packed" in str(e) and "\n" not in str(e)
  else:
    raise AssertionError("a stage of another shape was stacked")


def _mixed_trees():
  rng = np.random.default_rng(1)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # pylint: disable=unnecessary-lambda-assignment
  return [{"w": f(2, 3), "b": f(3), "n": np.int32(7)},
          {"a": f(4), "b": (f(5),), "c": np.ones(2, jnp.bfloat16)},
          {}]


def _numpy_pack(layout, stage, tree):
  """Stage `stage`'s row, laid out from `layout.slots` by NumPy."""
  rows = {k: np.zeros(n, np.float64) for k, n in layout.lengths.items()}
  for leaf, (dtype, offset, shape) in zip(jax.tree.leaves(tree),
                                          layout.slots[stage]):
    n = int(np.prod(shape))
    rows[dtype][offset:offset + n] = np.ravel(np.asarray(leaf, np.float64))
  return rows


def test_pieces_have_one_shape_on_every_stage_and_concatenate_to_the_row():
  trees = _mixed_trees()
  layout = packing.Packing(trees)
  shapes = None
  for s, tree in enumerate(trees):
    pieces = jax.jit(lambda t, s=s: layout.pieces(s, t))(tree)
    got = jax.tree.map(lambda v: (v.shape, v.dtype), pieces)
    assert shapes is None or got == shapes, (s, got, shapes)
    shapes = got
    want = _numpy_pack(layout, s, tree)
    for dtype, row in pieces.items():
      np.testing.assert_array_equal(
          np.concatenate([np.asarray(p, np.float64) for p in row]),
          want[dtype], err_msg=f"stage {s}, {dtype}")
  # Cut at every stage's leaf boundary (leaves in sorted-key order): float32
  # leaves end at 3 ("b") and 9 ("w") on stage 0, at 4 ("a") and 9 on stage 1.
  assert layout.cuts["float32"] == [0, 3, 4, 9]


def test_pieces_of_stages_of_one_structure_are_their_whole_leaves():
  trees = _uniform_trees()
  layout = packing.Packing(trees)
  sizes = [np.size(v) for v in jax.tree.leaves(trees[0])
           if np.asarray(v).dtype == np.float32]
  assert [p.shape[0] for p in layout.pieces(1, trees[1])["float32"]] == sizes


@pytest.mark.parametrize("stacked", [False, True])
def test_join_of_pieces_is_the_packed_row(stacked):
  trees = _uniform_trees() if stacked else _mixed_trees()
  layout = (packing.Stacking if stacked else packing.Packing)(trees)
  for s, tree in enumerate(trees):
    got = jax.jit(lambda t, s=s: layout.join(layout.pieces(s, t)))(tree)
    want = (_numpy_pack(layout, s, tree) if not stacked else
            {k: np.asarray(v, np.float64) for k, v in zip(
                layout.keys, jax.tree.leaves(tree))})
    assert sorted(got) == sorted(want)
    for k, v in got.items():
      np.testing.assert_array_equal(np.asarray(v, np.float64), want[k],
                                    err_msg=f"stage {s}, {k}")
