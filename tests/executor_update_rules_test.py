"""Update rules through the pipeline contract: executor == oracle, and SAPipe's
weight prediction against a hand-written data-parallel loop (seed 004 Alg. 3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from stalepipe.train import optimizers

ATOL, RTOL = 3e-6, 2e-5


def _windows(num, B, M, n, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))


def _close(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, w, atol=ATOL, rtol=RTOL)


def _run_both(schedule, optimizer, D, num_windows=3, seed=2, **kwargs):
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, max(S - 1, 1), 4, seed=seed), S)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  ex = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, optimizer,
                         mesh, **kwargs)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, num_replicas=D, **kwargs)
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  B, M = schedule.num_minibatches, schedule.num_microbatches
  for x, y in _windows(num_windows, B, M, 2 * D):
    es, em = ex.step(es, x, y)
    rs, rm = ref.step(rs, x, y)
    if rm["num_losses"]:
      np.testing.assert_allclose(em["loss"], rm["loss"], rtol=RTOL)
  for d in range(D):
    _close(ex.params(es, d), ref.params(rs, d))
  return staged, ref.params(rs)


def _plain(schedule, optimizer, staged, D, num_windows=3):
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, num_replicas=D)
  state = ref.init(staged.stage_params)
  B, M = schedule.num_minibatches, schedule.num_microbatches
  for x, y in _windows(num_windows, B, M, 2 * D):
    state, _ = ref.step(state, x, y)
  return ref.params(state)


def _differs(a, b):
  return max(float(jnp.abs(x - y).max())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) > 1e-4


_RULES = {
    "wp1": lambda D: sp.optim.WeightPrediction(optax.sgd(0.3, 0.9), option=1,
                                               num_workers=D),
    "wp2": lambda D: sp.optim.WeightPrediction(optax.sgd(0.3, 0.9), option=2,
                                               num_workers=D),
    "wp3": lambda D: sp.optim.WeightPrediction(optax.sgd(0.3, 0.9), option=3,
                                               num_workers=D, lam=0.2),
    "spectrain": lambda D: sp.optim.SpecTrain(optax.sgd(0.3, 0.9)),
    "spectrain_minibatch": lambda D: sp.optim.SpecTrain(
        optax.sgd(0.3, 0.9), staleness="minibatch"),
    "pipemare": lambda D: sp.optim.PipeMare(optax.sgd(0.3), warmup_steps=4,
                                            decay=0.5),
    "gap_aware": lambda D: optax.chain(
        sp.optim.gap_aware(0.3, form="sgd", momentum=0.9),
        optax.sgd(0.3, 0.9)),
    "dc_asgd_ema": lambda D: optax.chain(sp.optim.dc_asgd_ema(1.0),
                                         optax.sgd(0.3, 0.9)),
    "weight_pred": lambda D: sp.optim.SpecTrain(
        optax.sgd(0.3, 0.9), staleness="minibatch", horizon_scale=0.5),
}
_NO_STASH = {"weight_stashing": False}
# (rule, schedule, options, S, D, M): WP where SAPipe runs it (flush
# schedules, data parallel); SpecTrain and PipeMare on asynchronous pipelines
# without weight stashing (their setting), where a backward reads newer
# weights than its forward (since_forward > 0), SpecTrain's paper staleness
# with one micro-batch per minibatch (stages k >= 2 predict k // 2 further),
# its per-minibatch one with two and with stashing, PipeMare on nF1B, and
# the 2025-26 rules on PipeDream with weight stashing (Gap-Aware's and
# marin's delay correctors: stale_params is the stash; marin's weight_pred
# predicts each task to its minibatch's update, half the horizon).
_CASES = [pytest.param("wp1", "gpipe", {}, 1, 4, 2, marks=pytest.mark.slow),
          ("wp2", "1f1b", {}, 2, 2, 2),
          pytest.param("wp3", "gpipe", {}, 2, 2, 2, marks=pytest.mark.slow),
          pytest.param("wp3", "gpipe", {}, 1, 4, 2, marks=pytest.mark.slow),
          ("spectrain", "pipedream", _NO_STASH, 3, 1, 1),
          pytest.param("spectrain", "pipedream", _NO_STASH, 4, 2, 1,
                       marks=pytest.mark.slow),
          ("spectrain_minibatch", "pipedream", _NO_STASH, 3, 1, 2),
          pytest.param("spectrain_minibatch", "pipedream", {}, 3, 2, 2,
                       marks=pytest.mark.slow),
          pytest.param("pipemare", "timeprest", {}, 3, 1, 2,
                       marks=pytest.mark.slow),
          ("pipemare", "pipedream", _NO_STASH, 3, 2, 2),
          ("gap_aware", "pipedream", {}, 2, 1, 1),
          ("dc_asgd_ema", "pipedream", {}, 2, 1, 1),
          ("weight_pred", "pipedream", {}, 2, 1, 1)]


@pytest.mark.parametrize("rule,name,options,S,D,M", _CASES)
def test_update_rule_executor_equals_oracle(rule, name, options, S, D, M):
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=2, **options)
  staged, got = _run_both(schedule, _RULES[rule](D), D)
  # The rule really acts: without it (its inner optimizer) the run differs.
  inner = optax.sgd(0.3, 0.9) if rule != "pipemare" else optax.sgd(0.3)
  assert _differs(got, _plain(schedule, inner, staged, D))


def test_muon_executor_equals_oracle_on_pipedream():
  """Muon reduces over one leaf at most, so each stage's own tree is the
  model's update; the scope is named because `optimizer_scope="auto"`
  compares float32 Newton-Schulz runs, which differ by rounding (6e-6)."""
  schedule = sp.schedules.make("pipedream", num_stages=2, num_microbatches=1,
                               num_minibatches=2)
  opt = optimizers.muon(0.05, mask="all_matrices")
  staged, got = _run_both(schedule, opt, 1, optimizer_scope="stage")
  assert _differs(got, _plain(schedule, optax.adamw(0.05, weight_decay=0.0),
                              staged, 1))


@pytest.mark.parametrize("S,same", [(2, True), (3, False)])
def test_spectrain_staleness_variants_differ_from_stage_2(S, same):
  """With 2 stages the paper's staleness and the per-minibatch one coincide
  (floor(k/2) = 0, and the pipeline fills on version 0); with 3 they don't."""
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=1,
                               num_minibatches=2, **_NO_STASH)
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=2), S)
  paper = _plain(schedule, _RULES["spectrain"](1), staged, 1)
  minibatch = _plain(schedule, _RULES["spectrain_minibatch"](1), staged, 1)
  assert _differs(paper, minibatch) != same
  if same:
    _close(paper, minibatch)


@pytest.mark.parametrize("name,options,M", [
    ("pipedream", _NO_STASH, 2), ("pipedream", {}, 1),
    ("pipedream", {"vertical_sync": True, "weight_stashing": False}, 1),
    ("1f1b", {}, 1), ("gpipe", {}, 1)])
def test_spectrain_paper_staleness_is_refused_where_undefined(name, options,
                                                              M):
  schedule = sp.schedules.make(name, num_stages=3, num_microbatches=M,
                               num_minibatches=2, **options)
  staged = sp.models.split(sp.models.mlp(8, 6, 2, 4), 3)
  mesh = jax.make_mesh((1, 3), ("data", "stage"))
  for build in (
      lambda opt: executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                                    opt, mesh),
      lambda opt: reference.Pipeline(staged.stage_fns, cross_entropy,
                                     schedule, opt)):
    with pytest.raises(ValueError, match="no SpecTrain pipeline-wide") as err:
      build(_RULES["spectrain"](1))
    assert "\n" not in str(err.value) and "valid:" in str(err.value)
    build(_RULES["spectrain_minibatch"](1))  # the variant runs anywhere


@pytest.mark.parametrize("rule,name,options,policy,D,M", [
    ("pipemare", "hetpipe", {"concurrent_minibatches": 2},
     lambda D: sp.sync.wsp(D, 1, 2), 2, 2),
    ("spectrain", "pipedream", _NO_STASH,
     lambda D: sp.sync.ad_psgd(D, seed=1), 4, 1),
    ("wp1", "1f1b", {}, lambda D: sp.sync.local_sgd(D, period=4), 2, 2),
])
def test_update_rule_with_a_sync_policy_executor_equals_oracle(
    rule, name, options, policy, D, M):
  S = 2
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=2, **options)
  # Without a gradient all-reduce WP's synchronised gradient is its own.
  optimizer = _RULES[rule](1)
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=6), S)
  ex = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, optimizer,
                         jax.make_mesh((D, S), ("data", "stage")),
                         sync=policy(D))
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, num_replicas=D, sync=policy(D))
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in _windows(3, 2, M, 2 * D):
    es, _ = ex.step(es, x, y)
    rs, _ = ref.step(rs, x, y)
  for d in range(D):
    _close(ex.params(es, d), ref.params(rs, d))
  assert _differs(ref.params(rs, 0), ref.params(rs, 1))  # not BSP in disguise


@pytest.mark.parametrize("name,stale", [
    # seed 003: v = 1 iff W <= N + 1 (3 <= 3): one update sequence, gradients
    # fresh at their update; PipeDream: version p - (S - 1 - s), stale.
    ("timeprest", False), ("pipedream", True)])
def test_pipeline_hands_the_contract_arguments(name, stale):
  """`staleness`, `local_updates`, predict's `ahead`/`since_forward` are the
  schedule's; `stale_params` comes only where the schedule makes gradients
  stale (recorded from the oracle)."""
  seen = {"update": [], "predict": []}

  class Recorder:
    def init(self, params):
      return optax.sgd(0.1).init(params)

    def update(self, grads, state, params, **kwargs):
      seen["update"].append((int(kwargs["staleness"]),
                             "stale_params" in kwargs,
                             kwargs["local_updates"] is not None))
      return optax.sgd(0.1).update(grads, state, params)

    def predict(self, state, weights, *, ahead, since_forward):
      seen["predict"].append((int(ahead), int(since_forward)))
      return weights

  schedule = sp.schedules.make(name, num_stages=3, num_microbatches=2,
                               num_minibatches=4)
  staged = sp.models.split(sp.models.mlp(8, 6, 2, 4), 3)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           Recorder())
  # Building it stepped the rule on a stand-in model (`scope.couples_stages`).
  seen["update"].clear()
  seen["predict"].clear()
  x, y = next(_windows(1, 4, 2, 2))
  ref.step(ref.init(staged.stage_params), x, y)
  stream = schedule.with_minibatches(8)
  end = min(t.tick for t in stream.tasks  # window 0 ends where minibatch 4
            if t.minibatch == 4 and t.stage == 0)  # enters the pipeline
  want = sorted(
      (stream.update_version(s, p) - stream.forward_version(s, p), stale, True)
      for (s, p), u in stream.update_ticks.items() if u < end)
  assert sorted(seen["update"]) == want
  assert seen["update"] and max(t for t, _, _ in seen["update"]) > 0
  assert all(a >= 0 and b >= 0 for a, b in seen["predict"])
  if name == "timeprest":
    assert any(b > 0 for _, b in seen["predict"])  # nF1B backward reads newer


def test_pipeline_hands_pipeline_ahead_to_a_pipeline_wide_rule():
  """A rule whose `staleness` is "pipeline" gets `Schedule.pipeline_ahead`
  for every task (recorded from the oracle); others never get it (above)."""
  seen = []

  class Recorder:
    staleness = "pipeline"

    def init(self, params):
      return optax.sgd(0.1).init(params)

    def update(self, grads, state, params, **kwargs):
      del kwargs
      return optax.sgd(0.1).update(grads, state, params)

    def predict(self, state, weights, *, ahead, since_forward,
                pipeline_ahead):
      del state, ahead, since_forward
      seen.append(int(pipeline_ahead))
      return weights

  schedule = sp.schedules.make("pipedream", num_stages=4, num_microbatches=1,
                               num_minibatches=4, **_NO_STASH)
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4), 4)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           Recorder())
  seen.clear()
  x, y = next(_windows(1, 4, 1, 2))
  ref.step(ref.init(staged.stage_params), x, y)
  stream = schedule.with_minibatches(8)
  end = min(t.tick for t in stream.tasks if t.minibatch == 4 and t.stage == 0)
  want = [stream.pipeline_ahead(t) for t in stream.tasks if t.tick < end]
  assert sorted(seen) == sorted(want) and max(want) == 3


@pytest.mark.parametrize("option", [
    1, pytest.param(2, marks=pytest.mark.slow),
    pytest.param(3, marks=pytest.mark.slow)])
def test_sapipe_weight_prediction_equals_a_data_parallel_loop(option):
  """Seed 004 Algorithm 3 as a user writes it (the WeightPrediction
  docstring's train_step, per worker, gradients averaged by hand) equals the
  executor on D replicas x 1 stage with a flush schedule."""
  D, steps, lr = 4, 6, 0.3
  wp = sp.optim.WeightPrediction(optax.sgd(lr, 0.9), option=option,
                                 num_workers=D, lam=0.2)
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=4), 1)
  model = sp.models.unpipelined(staged)
  schedule = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1,
                               num_minibatches=steps)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, wp,
                           jax.make_mesh((D, 1), ("data", "stage")))
  state = pipe.init(staged.stage_params)
  x, y = next(_windows(1, steps, 1, 2 * D, seed=5))
  state, _ = pipe.step(state, x, y)

  params = staged.stage_params
  states = [wp.init(params) for _ in range(D)]
  for t in range(steps):
    local = []
    for d in range(D):
      x_hat = wp.predict(states[d], params)
      xs, ys = x[t, 0, 2 * d:2 * d + 2], y[t, 0, 2 * d:2 * d + 2]
      local.append(jax.grad(lambda w: cross_entropy(model(w, xs), ys))(x_hat))  # pylint: disable=cell-var-from-loop
    synced = jax.tree.map(lambda *g: sum(g) / D, *local)
    new = []
    for d in range(D):
      updates, states[d] = wp.update(synced, states[d], params,
                                     local_updates=local[d])
      new.append(optax.apply_updates(params, updates))
    params = new[0]
  _close(pipe.params(state), params)


def test_weight_prediction_must_count_the_replicas_it_averages():
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4), 1)
  schedule = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1)
  mesh = jax.make_mesh((4, 1), ("data", "stage"))
  with pytest.raises(ValueError, match="num_workers=2 does not fit"):
    executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                      sp.optim.WeightPrediction(optax.sgd(0.1), 3,
                                                num_workers=2), mesh)
  with pytest.raises(ValueError, match="num_workers=4 does not fit"):
    reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                       sp.optim.WeightPrediction(optax.sgd(0.1), 3,
                                                 num_workers=4),
                       num_replicas=4, sync=sp.sync.local_sgd(4, 2))


def _data_parallel(optimizer, D, steps, seed=5):
  """The executor on D replicas x 1 stage (a flush schedule) and the same
  optimizer in a hand-written data-parallel loop (gradients averaged)."""
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=4), 1)
  model = sp.models.unpipelined(staged)
  schedule = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1,
                               num_minibatches=steps)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, jax.make_mesh((D, 1), ("data", "stage")))
  state = pipe.init(staged.stage_params)
  x, y = next(_windows(1, steps, 1, 2 * D, seed=seed))
  state, _ = pipe.step(state, x, y)
  params, opt_state = staged.stage_params, optimizer.init(staged.stage_params)
  for t in range(steps):
    synced = jax.tree.map(lambda *g: sum(g) / D, *[
        jax.grad(lambda w: cross_entropy(  # pylint: disable=cell-var-from-loop
            model(w, x[t, 0, 2 * d:2 * d + 2]), y[t, 0, 2 * d:2 * d + 2]))(
                params) for d in range(D)])
    updates, opt_state = optimizer.update(synced, opt_state, params)
    params = optax.apply_updates(params, updates)
  return pipe.params(state), params


def test_sapipe_dc_compensates_its_own_delay_on_a_flush_schedule():
  """SAPipe-DC: the all-reduced gradient applied one step late, compensated
  with full DC for x_t - x_{t-1} from the transform's own history. On a
  flush schedule the executor passes no stale_params (the schedule's
  gradients are fresh), so the chain runs as in user code."""
  sgd = optax.sgd(0.3, 0.9)
  dc = optax.chain(sp.optim.stale_gradients(1),
                   sp.optim.delay_compensation(2.0, form="full", delay=1), sgd)
  got, want = _data_parallel(dc, D=4, steps=6)
  _close(got, want)
  plain, _ = _data_parallel(optax.chain(sp.optim.stale_gradients(1), sgd), 4, 6)
  assert _differs(got, plain)  # the compensation really acts
