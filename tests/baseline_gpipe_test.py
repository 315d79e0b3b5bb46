"""The MaxText-style GPipe baseline (experiments/) against unpipelined training."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy as classification_loss

_PATH = pathlib.Path(__file__).parent.parent / "experiments" / "baseline_gpipe.py"
_SPEC = importlib.util.spec_from_file_location("baseline_gpipe", _PATH)
baseline_gpipe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(baseline_gpipe)

S, M, H, N = 4, 3, 8, 4  # stages, micro-batches, width, examples (2 replicas)


@pytest.fixture(scope="module")
def setup():
  staged = sp.models.split(sp.models.mlp(H, H, 2 * S - 1, H, seed=1), S)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(M, N, H)).astype(np.float32)
  y = rng.integers(0, H, size=(M, N)).astype(np.int32)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  return staged, x, y, mesh


def _unpipelined_loss(staged):
  model = sp.models.unpipelined(staged)
  return lambda params, x, y: jnp.mean(jnp.stack(
      [classification_loss(model(params, x[m]), y[m]) for m in range(M)]))


def test_loss_and_gradients_equal_unpipelined(setup):
  staged, x, y, mesh = setup
  baseline = baseline_gpipe.GPipeBaseline(
      baseline_gpipe.mlp_stage, classification_loss, optax.sgd(0.1), mesh)
  params, _ = baseline.init(staged.stage_params)
  loss, grads = baseline.grad(params, *baseline.put_batch(x, y))
  want_loss, want_grads = jax.value_and_grad(_unpipelined_loss(staged))(
      staged.stage_params, x, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  got = jax.tree.leaves(grads)
  want = jax.tree.leaves(baseline_gpipe.stack_stages(want_grads))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


def test_steps_equal_plain_sgd(setup):
  staged, x, y, mesh = setup
  baseline = baseline_gpipe.GPipeBaseline(
      baseline_gpipe.mlp_stage, classification_loss, optax.sgd(0.5), mesh)
  params, opt_state = baseline.init(staged.stage_params)
  xs, ys = baseline.put_batch(x, y)
  want, loss_fn = staged.stage_params, _unpipelined_loss(staged)
  for _ in range(2):
    params, opt_state, _ = baseline.step(params, opt_state, xs, ys)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, want,
                        jax.grad(loss_fn)(want, x, y))
  for g, w in zip(jax.tree.leaves(params),
                  jax.tree.leaves(baseline_gpipe.stack_stages(want)),
                  strict=True):
    np.testing.assert_allclose(g, w, atol=2e-6, rtol=1e-5)
