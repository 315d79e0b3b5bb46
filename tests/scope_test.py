"""Whole-model update rules in a pipeline: equal to unpipelined training."""

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from stalepipe.pipeline import scope
from tests import unpipelined


def _clip():
  return optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))


def _full_dc():
  return optax.chain(sp.optim.delay_compensation(2.0, form="full"),
                     optax.sgd(0.5))


def _windows(num, B, M, n, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))


def _unpipelined(staged, optimizer, windows):
  """Plain optax on the whole model: one update per minibatch, on the mean
  of its micro-batches' gradients."""
  model = sp.models.unpipelined(staged)
  return unpipelined.train(lambda p, x, y: cross_entropy(model(p, x), y),
                           tuple(staged.stage_params), optimizer, windows)


def _close(got, want, atol=2e-6):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("name,make_optimizer,D", [
    pytest.param("1f1b", _clip, 2, marks=pytest.mark.slow), ("gpipe", _clip, 1),
    pytest.param("zb-h1", _clip, 1, marks=pytest.mark.slow),
    pytest.param("1f1b", _full_dc, 1, marks=pytest.mark.slow)])
def test_whole_model_rule_equals_unpipelined_training(name, make_optimizer, D):
  S, M, B = 4, 2, 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=1), S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           make_optimizer(), mesh)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           make_optimizer(), num_replicas=D)
  assert pipe.optimizer_scope == ref.optimizer_scope == "model"
  windows = list(_windows(3, B, M, 2 * D))
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  want = _unpipelined(staged, make_optimizer(), windows)
  for d in range(D):
    _close(pipe.params(state, d), want)
  _close(ref.params(rstate), want)
  # Per-stage clipping would have given other numbers.
  stage_wise = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                                 make_optimizer(), mesh,
                                 optimizer_scope="stage")
  state = stage_wise.init(staged.stage_params)
  for x, y in windows:
    state, _ = stage_wise.step(state, x, y)
  gap = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(stage_wise.params(state)), jax.tree.leaves(want)))
  assert gap > 1e-4


def test_asynchronous_schedule_with_a_whole_model_rule_is_refused():
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=1), 2)
  schedule = sp.schedules.make("pipedream", num_stages=2, num_microbatches=2)
  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  for make in (lambda **kw: executor.Pipeline(
      staged.stage_fns, cross_entropy, schedule, _clip(), mesh, **kw),
               lambda **kw: reference.Pipeline(
                   staged.stage_fns, cross_entropy, schedule, _clip(), **kw)):
    with pytest.raises(ValueError, match="optimizer_scope='stage'") as e:
      make()
    assert "\n" not in str(e.value)
    assert make(optimizer_scope="stage").optimizer_scope == "stage"


def test_per_stage_scope_equals_the_oracle_on_an_asynchronous_schedule():
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=1), 2)
  schedule = sp.schedules.make("pipedream", num_stages=2, num_microbatches=2)
  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, _clip(),
                           mesh, optimizer_scope="stage")
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule, _clip(),
                           optimizer_scope="stage")
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in _windows(3, 1, 2, 2):
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  _close(pipe.params(state), ref.params(rstate))


@pytest.mark.parametrize("optimizer,couples", [
    (optax.sgd(0.1), False), (optax.adam(0.1), False),
    (optax.chain(optax.clip(0.1), optax.sgd(0.1)), False),
    (optax.chain(sp.optim.delay_compensation(0.5), optax.sgd(0.1)), False),
    (_clip(), True),
    (optax.chain(optax.clip_by_global_norm(1e3), optax.sgd(0.1)), True),
    (_full_dc(), True)])
def test_couples_stages(optimizer, couples):
  assert scope.couples_stages(optimizer) == couples


def test_unknown_scope_is_refused():
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2)
  with pytest.raises(ValueError, match="valid: auto, model, stage"):
    scope.resolve("global", optax.sgd(0.1), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["timeprest", "zb-async"])
def test_whole_model_rule_on_a_stale_schedule_equals_the_oracle(name):
  S = 3
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=1), S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=S,
                               num_minibatches=2)
  mesh = jax.make_mesh((1, S), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, _clip(),
                           mesh)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule, _clip())
  assert pipe.optimizer_scope == "model"
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in _windows(3, 2, S, 2):
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  _close(pipe.params(state), ref.params(rstate))
