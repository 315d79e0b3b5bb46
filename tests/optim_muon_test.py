"""Muon by name from a config: `optax.contrib.muon` with a named mask, and its step in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stalepipe.train import optimizers

_NS = (3.4445, -4.7750, 2.0315)  # optax/contrib/_muon.py line 42


def _params(rng, dtype=np.float32):
  return {"blocks.0.fc.kernel": rng.normal(size=(4, 6)).astype(dtype),
          "blocks.0.proj.kernel": rng.normal(size=(6, 4)).astype(dtype),
          "blocks.0.fc.bias": rng.normal(size=(6,)).astype(dtype),
          "head": {"kernel": rng.normal(size=(4, 3)).astype(dtype)},
          "embed": {"embedding": rng.normal(size=(5, 4)).astype(dtype)}}


def _run(opt, params, steps=4):
  rng = np.random.default_rng(7)
  state, update = opt.init(params), jax.jit(opt.update)
  for _ in range(steps):
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(p.dtype),
                         params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_config_built_muon_equals_hand_built_with_the_same_selection():
  params = _params(np.random.default_rng(0))
  built = optimizers.make((), "muon", {"learning_rate": 0.02,
                                       "mask": "attention_mlp"},
                          weight_decay=0.01, weight_decay_mode="decoupled")
  muon_leaf = optax.contrib.MuonDimensionNumbers()
  dims = {"blocks.0.fc.kernel": muon_leaf, "blocks.0.proj.kernel": muon_leaf,
          "blocks.0.fc.bias": None, "head": {"kernel": None},
          "embed": {"embedding": None}}
  hand = optax.contrib.muon(0.02, weight_decay=0.01, adam_weight_decay=0.01,
                            muon_weight_dimension_numbers=dims)
  got, want = _run(built, params), _run(hand, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The mask matters: optax's default also orthogonalises head and embedding.
  default = _run(optax.contrib.muon(0.02, weight_decay=0.01,
                                    adam_weight_decay=0.01), params)
  assert np.abs(default["head"]["kernel"] - got["head"]["kernel"]).max() > 1e-3
  np.testing.assert_allclose(default["blocks.0.fc.bias"],
                             got["blocks.0.fc.bias"], rtol=1e-6)


def _np_newton_schulz(m, steps=5, eps=1e-8):
  """The quintic iteration of `orthogonalize_via_newton_schulz` (lines
  323-366): on the wide orientation, from the Frobenius-normalised matrix."""
  transposed = m.shape[0] > m.shape[1]
  x = m.T if transposed else m
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = _NS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)])
def test_muon_steps_equal_numpy_nesterov_and_newton_schulz(shape):
  rng = np.random.default_rng(1)
  lr, beta = 0.05, 0.95
  with jax.enable_x64(True):
    x = rng.normal(size=shape)
    opt = optimizers.muon(lr, mask="all_matrices")
    state, update = opt.init(x), jax.jit(opt.update)
    m = np.zeros(shape)
    for t in range(1, 4):
      g = rng.normal(size=shape)
      u, state = update(jnp.asarray(g), state, jnp.asarray(x))
      # scale_by_muon (lines 486-497): EMA momentum, Nesterov with bias
      # corrections; scale_by_shape (lines 140-146): sqrt(max(1, out / in)).
      m = beta * m + (1 - beta) * g
      nesterov = (beta * m / (1 - beta ** (t + 1))
                  + (1 - beta) * g / (1 - beta ** t))
      want = -lr * np.sqrt(max(1, shape[1] / shape[0])) * _np_newton_schulz(
          nesterov)
      np.testing.assert_allclose(np.asarray(u), want, rtol=1e-10, atol=1e-12)
      x = x + want
  # Newton-Schulz is near-orthogonalising: singular values in about [0.7, 1.2].
  s = np.linalg.svd(_np_newton_schulz(rng.normal(size=shape)),
                    compute_uv=False)
  assert s.min() > 0.6 and s.max() < 1.25


@pytest.mark.parametrize("kwargs,match", [
    ({"mask": "heads"}, "unknown mask 'heads'; valid: "),
    ({"muon_weight_dimension_numbers": None},
     "muon takes no 'muon_weight_dimension_numbers' here; valid: mask, "),
    ({"momentum": 0.9}, "muon takes no 'momentum' here; valid: mask, "),
])
def test_bad_muon_arguments_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match) as err:
    optimizers.muon(0.02, **kwargs)
  assert "\n" not in str(err.value)
