"""Draining an asynchronous run: the final weights hold every minibatch."""

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference


@pytest.mark.parametrize("name,S,M", [
    pytest.param("pipedream", 3, 2, marks=pytest.mark.slow), ("2bw", 2, 2),
    pytest.param("1f1b", 2, 2, marks=pytest.mark.slow)])
def test_drain_equals_the_oracles_and_applies_every_update(name, S, M):
  B, D, windows = 2, 1, 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=4), S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.3), mesh)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.3))
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  rng = np.random.default_rng(0)
  for _ in range(windows):
    x = rng.normal(size=(B, M, 2, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=(B, M, 2)).astype(np.int32)
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  state, metrics = pipe.drain(state)
  rstate, rmetrics = ref.drain(rstate)
  assert int(metrics["num_losses"]) == rmetrics["num_losses"]
  # Every stage applied exactly one update per minibatch trained on.
  latest = pipe.updates_applied(state)
  np.testing.assert_array_equal(latest, windows * B)
  assert all(len(v) == windows * B + 1 for v in rstate.versions.values())
  for a, b in zip(jax.tree.leaves(pipe.params(state)),
                  jax.tree.leaves(ref.params(rstate))):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_a_drained_state_takes_no_further_step():
  """PipeDream S = 2: two windows, a drain, then a third window would train
  on a pipeline whose in-flight work is finished, as no schedule does: the
  executor and the oracle refuse it in one line, and a second drain."""
  S, M, B = 2, 2, 1
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=4), S)
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.3), jax.make_mesh((1, S),
                                                         ("data", "stage")))
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.3))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, M, 2, 8)).astype(np.float32)
  y = rng.integers(0, 4, size=(B, M, 2)).astype(np.int32)
  for runner in (pipe, ref):
    state = runner.init(staged.stage_params)
    for _ in range(2):
      state, _ = runner.step(state, x, y)
    state, _ = runner.drain(state)
    with pytest.raises(ValueError, match="drained .* no further step"):
      runner.step(state, x, y)
    with pytest.raises(ValueError, match="drained"):
      runner.drain(state)
