"""The forward-only window against the unpipelined model."""

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy


@pytest.mark.parametrize("name", [
    pytest.param("1f1b", marks=pytest.mark.slow), "pipedream",
    pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_evaluate_equals_the_unpipelined_forward_and_changes_nothing(name):
  S, M, B, D = 4, 2, 2, 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=2), S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = sp.pipeline.Pipeline(staged.stage_fns, cross_entropy, schedule,
                              optax.sgd(0.3), mesh)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, M, 2 * D, 8)).astype(np.float32)
  y = rng.integers(0, 4, size=(B, M, 2 * D)).astype(np.int32)
  state = pipe.init(staged.stage_params)
  state, _ = pipe.step(state, x, y)
  before = pipe.params(state)
  metrics = pipe.evaluate(state, x, y)
  model = sp.models.unpipelined(staged)
  want = np.stack([np.stack([model(before, x[b, m]) for m in range(M)])
                   for b in range(B)])
  np.testing.assert_allclose(metrics["outputs"], want, atol=1e-6)
  losses = [cross_entropy(want[b, m], y[b, m]) for b in range(B)
            for m in range(M)]
  np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(pipe.params(state)),
                  jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
