"""Sync policies across pipelines, in the executor and in the oracle."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference

D, S = 4, 2


def _staged(seed=1):
  return sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=seed), S)


def _windows(num, B, M, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, 2 * D, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, 2 * D)).astype(np.int32))


def _replica_params(pipe, state):
  return [np.concatenate([np.ravel(x) for x in jax.tree.leaves(
      pipe.params(state, r))]) for r in range(D)]


def _train(schedule, policy, num_windows=4, optimizer=None):
  staged = _staged()
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer or optax.sgd(0.5),
                           jax.make_mesh((D, S), ("data", "stage")), sync=policy)
  state = pipe.init(staged.stage_params)
  spreads = []
  for x, y in _windows(num_windows, schedule.num_minibatches,
                       schedule.num_microbatches):
    state, _ = pipe.step(state, x, y)
    params = _replica_params(pipe, state)
    spreads.append(max(np.abs(p - params[0]).max() for p in params))
  return _replica_params(pipe, state), spreads


# A straggler trace: worker 3 signals late on stage 0 in every iteration, and
# stage 1 sees two fast pairs.
_READY = np.tile([[[0.0, 0.01, 0.02, 1.0], [0.0, 0.01, 0.5, 0.51]]], (12, 1, 1))

_POLICIES = [
    ("hetpipe", lambda: sp.sync.wsp(D, clock_distance=1, concurrent_minibatches=2)),
    ("hetpipe", lambda: sp.sync.wsp(D, 2, 2, delays=[[0, 1, 2, 0]] * 6)),
    ("1f1b", lambda: sp.sync.sdpipe(D, history=3, window=0.1,
                                    ready_times=_READY)),
    ("pipedream", lambda: sp.sync.ad_psgd(D, seed=3)),
    ("timeprest", lambda: sp.sync.local_sgd(D, period=3)),
]


@pytest.mark.parametrize("name,policy", _POLICIES)
def test_executor_and_observed_staleness_equal_the_oracle(name, policy):
  kwargs = {"concurrent_minibatches": 2} if name == "hetpipe" else {}
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=2,
                               num_minibatches=2, **kwargs)
  staged = _staged()
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.5),
                           jax.make_mesh((D, S), ("data", "stage")),
                           sync=policy())
  oracle = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                              optax.sgd(0.5), num_replicas=D, sync=policy())
  es, rs = pipe.init(staged.stage_params), oracle.init(staged.stage_params)
  seen = {}  # the oracle's observed staleness, per minibatch
  for x, y in _windows(4, 2, 2):
    es, _ = pipe.step(es, x, y)
    rs, metrics = oracle.step(rs, x, y)
    seen.update(metrics["staleness"])
  # sp.sync.observed_staleness (prefix bookkeeping) equals the oracle's sets.
  fast = sp.sync.observed_staleness(schedule, policy(), 12).max(axis=0)
  assert [seen[p] for p in sorted(seen)] == fast[:len(seen)].tolist()
  spread = 0.0
  for r in range(D):
    for a, b, c in zip(jax.tree.leaves(pipe.params(es, r)),
                       jax.tree.leaves(oracle.params(rs, r)),
                       jax.tree.leaves(oracle.params(rs, 0))):
      np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
      spread = max(spread, float(jnp.abs(b - c).max()))
  assert spread > 1e-3  # replicas really differ: this is not BSP in disguise


@pytest.mark.parametrize("clock_distance,concurrent", [
    pytest.param(0, 4, marks=pytest.mark.slow), (1, 2),
    pytest.param(2, 3, marks=pytest.mark.slow)])
def test_wsp_observed_staleness_reaches_but_never_exceeds_s_global(
    clock_distance, concurrent):
  S4, n = 4, 2
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4), S4)
  schedule = sp.schedules.make("hetpipe", num_stages=S4, num_microbatches=1,
                               num_minibatches=concurrent,
                               concurrent_minibatches=concurrent)
  oracle = reference.Pipeline(
      staged.stage_fns, cross_entropy, schedule, optax.sgd(0.1),
      num_replicas=n, sync=sp.sync.wsp(n, clock_distance, concurrent))
  state, observed = oracle.init(staged.stage_params), {}
  rng = np.random.default_rng(0)
  for _ in range(30 // concurrent):
    x = rng.normal(size=(concurrent, 1, 2 * n, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=(concurrent, 1, 2 * n)).astype(np.int32)
    state, metrics = oracle.step(state, x, y)
    observed.update(metrics["staleness"])
  bound = sp.theory.wsp_global_staleness(clock_distance, concurrent - 1)
  assert max(observed.values()) == bound
  # Seed 001 §5: from then on p reflects every update of 0..p-s_global-1.
  assert all(s <= bound for s in observed.values())


def test_wsp_mean_server_with_distance_0_and_one_minibatch_waves_is_bsp():
  schedule = sp.schedules.make("hetpipe", num_stages=S, num_microbatches=2,
                               num_minibatches=2, concurrent_minibatches=1)
  wsp, _ = _train(schedule, sp.sync.wsp(D, 0, 1, server="mean"))
  bsp, spreads = _train(schedule, sp.sync.bsp(D))
  assert max(spreads) == 0.0
  for a, b in zip(wsp, bsp):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_wsp_server_sums_the_workers_updates():
  """Seed 001 §5: w_global <- w_global + u~ from every worker (eq. 1: weight
  1 each). With D=0 and one-minibatch waves every worker then holds
  x - lr * sum_d g_d after each update: BSP's mean gradient at D times lr."""
  schedule = sp.schedules.make("hetpipe", num_stages=S, num_microbatches=2,
                               num_minibatches=2, concurrent_minibatches=1)
  assert sp.sync.wsp(D, 0, 1).server == "sum"  # HetPipe is the default
  wsp, spreads = _train(schedule, sp.sync.wsp(D, 0, 1), num_windows=2,
                        optimizer=optax.sgd(0.05))
  bsp, _ = _train(schedule, sp.sync.bsp(D), num_windows=2,
                  optimizer=optax.sgd(0.05 * D))
  assert max(spreads) < 1e-7  # replicas agree up to the sum's rounding
  for a, b in zip(wsp, bsp):
    np.testing.assert_allclose(a, b, atol=1e-6)
  with pytest.raises(ValueError, match="server='max' is invalid"):
    sp.sync.wsp(D, 0, 1, server="max")


def test_sdpipe_with_p_1_is_all_reduce_even_with_stragglers():
  schedule = sp.schedules.make("1f1b", num_stages=S, num_microbatches=2,
                               num_minibatches=2)
  # A straggler on stage 0 only, so no enforcement is skipped for deadlock.
  ready = np.tile([[[0.0, 0.01, 0.02, 1.0], [0.0, 0.0, 0.0, 0.0]]], (12, 1, 1))
  policy = sp.sync.sdpipe(D, history=1, window=0.1, ready_times=ready)
  sd, _ = _train(schedule, policy)
  assert not policy.skipped
  bsp, _ = _train(schedule, sp.sync.bsp(D))
  for a, b in zip(sd, bsp):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_connectivity_keeps_a_permanently_slow_worker_close():
  """Seed 002 §3.3: without the P-iteration connectivity rule a worker that
  always signals too late for the others' group never averages and drifts."""
  schedule = sp.schedules.make("1f1b", num_stages=S, num_microbatches=1,
                               num_minibatches=2)
  k, j = np.arange(60)[:, None, None], np.arange(S)[None, :, None]
  ready = 10.0 * k + 6.0 * j + np.array([0.0, 0.01, 0.02, 5.0])
  kwargs = dict(history=3, window=0.1, ready_times=ready)
  kept_policy = sp.sync.sdpipe(D, **kwargs)
  _, free = _train(schedule, sp.sync.sdpipe(D, enforce=False, **kwargs), 24,
                   optax.sgd(0.1))
  _, kept = _train(schedule, kept_policy, 24, optax.sgd(0.1))
  assert not kept_policy.skipped
  assert np.mean(free[-6:]) > 2 * np.mean(free[:3])  # drifts away
  assert max(kept) < 0.6 * np.mean(free[-6:])  # stays close


def test_figure_3_deadlock_completes():
  """Seed 002 Figure 3: stage 0 must wait for A while stage 1 waits for B.

  Each stage's enforcement alone would wait for the other pipeline; the
  scheduler lets the first wait and skips the second, so it completes.
  """
  # Pipelines A=0, B=1. Stage 0: B ready first, A late; stage 1: A first.
  ready = np.array([[[1.0, 0.0], [0.1, 1.1]]])
  policy = sp.sync.sdpipe(2, history=1, window=0.01, ready_times=ready)
  w0, w1 = policy.mixing(0, 0), policy.mixing(1, 0)
  assert policy.skipped == [(1, 0)]  # stage 1's wait overlaps stage 0's
  np.testing.assert_allclose(w0, np.full((2, 2), 0.5))  # stage 0 enforced
  np.testing.assert_allclose(w1, np.eye(2))  # stage 1 went on alone
  # The simulated cluster under the same enforcement finishes every iteration.
  cluster = sp.sim.Cluster.grid(2, 2, devices_per_node=2)
  costs = sp.sim.StageCosts.uniform(2, 0.1, 0.2, param_bytes=1e6)
  result = sp.sim.simulate(
      sp.schedules.make("1f1b", num_stages=2, num_microbatches=1,
                        num_minibatches=20), cluster, costs,
      sp.sim.sdpipe(1, 0.01), perturbations=[sp.sim.Stragglers(0.5, 0.3)],
      seed=2)
  assert np.isfinite(result.makespan)


def test_wsp_program_holds_one_all_reduce_per_wave():
  """One window = one wave of N_m minibatches; only its push crosses 'data'."""
  concurrent = 2
  schedule = sp.schedules.make("hetpipe", num_stages=S, num_microbatches=1,
                               num_minibatches=concurrent,
                               concurrent_minibatches=concurrent)

  def collectives(policy):
    staged = _staged()
    pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                             optax.sgd(0.1),
                             jax.make_mesh((D, S), ("data", "stage")),
                             sync=policy)
    state = pipe.init(staged.stage_params)
    x, y = next(_windows(1, concurrent, 1))
    state, _ = pipe.step(state, x, y)
    hlo = pipe.compile(state, x, y).as_text()
    # all-reduces over a parameter-sized (non-scalar) operand
    return re.findall(r"= f32\[\d+\]\{0\} all-reduce\(", hlo), pipe

  wsp, pipe = collectives(sp.sync.wsp(D, 1, concurrent))
  assert len(wsp) == 1
  updates = pipe.program.tables.update[-1]
  assert updates.sum(axis=0).tolist() == [concurrent] * S  # N_m local updates
  bsp, _ = collectives(sp.sync.bsp(D))  # one per update, by contrast
  assert len(bsp) == 1


def test_bad_policies_are_rejected():
  with pytest.raises(ValueError, match="clock_distance=-1"):
    sp.sync.wsp(2, -1, 2)
  with pytest.raises(ValueError, match="delays of shape"):
    sp.sync.wsp(2, 1, 2, delays=[[0, 2]])
  with pytest.raises(ValueError, match=r"delays of shape \(0,\)"):
    sp.sync.wsp(2, 1, 2, delays=[])
  with pytest.raises(ValueError, match="unknown sync policy 'nope'"):
    sp.sync.make("nope", num_replicas=2)
  staged = _staged()
  with pytest.raises(ValueError, match="over 3 replicas does not fit"):
    executor.Pipeline(staged.stage_fns, cross_entropy,
                      sp.schedules.make("gpipe", num_stages=S,
                                        num_microbatches=1), optax.sgd(0.1),
                      jax.make_mesh((D, S), ("data", "stage")),
                      sync=sp.sync.bsp(3))


def test_sdpipe_without_a_trace_averages_every_stage_of_every_iteration():
  plan = sp.sync.sdpipe(D).plan(0, 3, 4)  # stages asked in any order
  assert plan["mix_on"].tolist() == [[1] * 4] * 3
  np.testing.assert_allclose(plan["mix"], np.full((3, 4, D, D), 1 / D))


def test_sdpipe_grouping_by_arrival_is_refused_by_the_executor():
  """Groups across iterations cannot run in lock step: the executor refuses
  the policy in one line when it asks it for its plan, before any work (the
  oracle asks the same `mixing`)."""
  schedule = sp.schedules.make("1f1b", num_stages=S, num_microbatches=2,
                               num_minibatches=2)
  staged = _staged()
  pipe = executor.Pipeline(
      staged.stage_fns, cross_entropy, schedule, optax.sgd(0.5),
      jax.make_mesh((D, S), ("data", "stage")),
      sync=sp.sync.sdpipe(D, history=3, window=0.1, grouping="arrival"))
  x, y = next(_windows(1, 2, 2))
  with pytest.raises(ValueError) as e:
    pipe.step(pipe.init(staged.stage_params), x, y)
  assert str(e.value) == (
      "grouping='arrival' forms groups across iterations, which the "
      "lockstep executor cannot run; valid: grouping='iteration' (the "
      "executor and the simulator) or 'arrival' (the simulator only)")
