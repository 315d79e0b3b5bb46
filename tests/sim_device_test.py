"""The simulator on device-level schedules: chunks that share a device.

Each check is against something computed without the engine: the schedules'
closed forms (docs/schedules.md), the sum of a device's task costs, a plain
walk over units of work written here, and `stalepipe.sim.reference`.
"""

import numpy as np
import pytest

import stalepipe as sp
from sim_engine_test import assert_same
from stalepipe import theory
from stalepipe.schedules import kinds
from stalepipe.sim import reference

P, V, M = 4, 2, 8
S = V * P
FREE = sp.sim.Link(np.inf, 0.0)  # zero-cost links
UNIT = {"F": 1.0, "B": 1.0, "W": 0.0}  # F = B = 1, an unsplit backward
SPLIT = {"F": 1.0, "B": 2.0, "W": 1.0}  # F = BI = BW = 1 (B = BI + BW = 2)
# name, options, unit costs, ticks a minibatch takes (closed forms)
CLOSED_FORMS = [
    ("interleaved-1f1b", {"num_devices": P}, UNIT,
     theory.interleaved_1f1b_makespan(P, V, M)),
    ("zb-v", {}, SPLIT, theory.zero_bubble_v_makespan(P, M)),
    ("dualpipev", {}, SPLIT, 4 * M + 3 * P),  # docs/schedules.md
]
# name, options, micro-batches, minibatches: every device-level schedule
DEVICE_LEVEL = [
    ("interleaved-1f1b", {"num_devices": P}, 4, 2),
    ("looped-bfs", {"num_devices": P}, 4, 2),
    ("zb-v", {}, 8, 2),
    ("dualpipev", {}, 8, 2),
    ("pipedream-interleaved", {"num_devices": P}, 1, 6),
    ("pipedream-v", {}, 1, 6),
]


def unit_costs(c, **kw):
  return sp.sim.StageCosts.uniform(S, c["F"], c["B"], weight_gradient=c["W"],
                                   **kw)


def random_costs(seed):
  rng = np.random.default_rng(seed)
  backward = rng.uniform(0.5, 2.0, S)
  return sp.sim.StageCosts(
      forward=tuple(rng.uniform(0.3, 1.5, S)), backward=tuple(backward),
      weight_gradient=tuple(backward * rng.uniform(0.2, 0.8, S)),
      activation_bytes=tuple(rng.uniform(1e8, 4e8, S)),
      param_bytes=tuple(rng.uniform(1e8, 1e9, S)),
      update=tuple(rng.uniform(0.0, 0.3, S)))


def random_cluster(seed, N=1):
  """P devices a pipeline, two a node, of unequal speeds; slow links."""
  rng = np.random.default_rng(seed)
  return sp.sim.Cluster(
      tuple(tuple(sp.sim.Device(speed=rng.uniform(0.5, 2.0),
                                node=(i * P + d) // 2) for d in range(P))
            for i in range(N)),
      intra=sp.sim.Link(1e9, 0.01), inter=sp.sim.Link(2e8, 0.05))


def task_seconds(schedule, costs, t):
  return costs.seconds(schedule.kind(t), t.stage) * len(
      schedule.covered_microbatches(t))


def device_seconds(schedule, costs):
  """`[P]` each device's task costs, an overlapped pair counted max(F, B)."""
  out = np.zeros(schedule.num_devices)
  for t in schedule.tasks:
    out[schedule.device(t)] += task_seconds(schedule, costs, t)
  for pair in schedule.overlapped:
    out[schedule.device(pair[0])] -= min(task_seconds(schedule, costs, t)
                                         for t in pair)
  return out


def plain_walk(schedule, cluster, costs):
  """Start and end of every task of pipeline 0, one unit of work at a time.

  A unit (a task, or an overlapped pair) starts when its device is free,
  every input is in (plus the transfer between two devices) and the versions
  it reads are applied; an update follows a stage's last backward of a
  minibatch on its device, and is in place when it ends.
  """
  row = cluster.devices[0]
  device = {s: schedule.device(next(t for t in schedule.tasks
                                    if t.stage == s)) for s in range(S)}
  closing = {}
  for i, t in enumerate(schedule.tasks):
    if schedule.kind(t).closes_update:
      closing[(t.stage, t.minibatch)] = i
  partner = {}
  for a, b in schedule.overlapped:
    partner[a], partner[b] = b, a
  start, end, made = {}, {}, {}
  free = [0.0] * schedule.num_devices
  applied = {(s, 0): 0.0 for s in range(S)}

  def moved(source, dest, num_bytes):
    a, b = device[source], device[dest]
    if a == b:
      return 0.0
    link = cluster.intra if row[a].node == row[b].node else cluster.inter
    return link.latency + num_bytes / link.bandwidth

  def ready(t):
    p, m, s, k = t.minibatch, t.microbatch, t.stage, schedule.kind(t)
    at = applied[(s, schedule.task_version(t))]
    last = schedule.covered_microbatches(t)[-1]
    if k.runs_forward and s > 0:
      return max(at, made[("y", p, m, s - 1)]
                 + moved(s - 1, s, costs.activation_bytes[s - 1]))
    if kinds.OUTPUT_COTANGENT in k.consumes and s < S - 1:
      n = len(schedule.covered_microbatches(t))
      return max(at, made[("dx", p, last, s + 1)]
                 + moved(s + 1, s, n * costs.activation_bytes[s]))
    return max(at, made.get(("y", p, last, s), 0.0))

  for i, t in enumerate(schedule.tasks):
    if t in start:
      continue
    unit = (t, partner[t]) if t in partner else (t,)
    d = device[t.stage]
    begin = max([free[d]] + [ready(u) for u in unit])
    for u in unit:
      speed = row[d].speed
      start[u], end[u] = begin, begin + task_seconds(schedule, costs, u) / speed
      k = schedule.kind(u)
      for m in schedule.covered_microbatches(u):
        if k.runs_forward:
          made[("y", u.minibatch, m, u.stage)] = end[u]
        if kinds.INPUT_COTANGENT in k.produces:
          made[("dx", u.minibatch, m, u.stage)] = end[u]
    free[d] = max(end[u] for u in unit)
    if closing.get((t.stage, t.minibatch)) == i:
      free[d] += costs.update[t.stage] / row[d].speed
      applied[(t.stage, t.minibatch + 1)] = free[d]
  return (np.array([start[t] for t in schedule.tasks]),
          np.array([end[t] for t in schedule.tasks]))


@pytest.mark.parametrize("name,kw,unit,ticks", CLOSED_FORMS)
def test_unit_costs_give_the_closed_forms(name, kw, unit, ticks):
  """Makespan, and each device's busy and idle seconds, as its ticks."""
  s = sp.schedules.make(name, num_stages=S, num_microbatches=M, **kw)
  costs = unit_costs(unit)
  r = sp.sim.simulate(s, sp.sim.Cluster.grid(1, P, intra=FREE, inter=FREE),
                      costs)
  assert r.makespan == ticks == s.num_ticks
  np.testing.assert_array_equal(r.device_busy[0], device_seconds(s, costs))
  np.testing.assert_array_equal(r.device_busy[0], s.device_busy.sum(axis=0))
  np.testing.assert_array_equal(r.device_idle[0],
                                s.num_ticks - s.device_busy.sum(axis=0))


def test_dualpipev_idles_its_readme_bubble():
  """Device r idles min(r + 1, P - 1) (docs/schedules.md); the last ones
  DeepSeek's (PP/2 - 1)(F&B + B - 3W)."""
  F, B, W = SPLIT["F"], SPLIT["B"], SPLIT["W"]
  s = sp.schedules.make("dualpipev", num_stages=S, num_microbatches=M)
  r = sp.sim.simulate(s, sp.sim.Cluster.grid(1, P, intra=FREE, inter=FREE),
                      unit_costs(SPLIT))
  np.testing.assert_array_equal(r.device_idle[0],
                                [min(d + 1, P - 1) for d in range(P)])
  assert r.device_idle[0].max() == theory.dualpipev_bubble(
      P, t_f_and_b=max(F, B), t_b=B, t_w=W)
  assert r.overlap[0].sum() == F * len(s.overlapped)


@pytest.mark.parametrize("name,kw,micro,B", DEVICE_LEVEL)
def test_engine_equals_a_plain_walk(name, kw, micro, B):
  s = sp.schedules.make(name, num_stages=S, num_microbatches=micro,
                        num_minibatches=B, **kw)
  c, costs = random_cluster(B), random_costs(B)
  r = sp.sim.simulate(s, c, costs)
  start, end = plain_walk(s, c, costs)
  np.testing.assert_allclose(r.start[:, 0], start, rtol=1e-12)
  np.testing.assert_allclose(r.end[:, 0], end, rtol=1e-12)
  assert r.makespan == pytest.approx(max(end.max(), r.applied.max()))


def test_chunks_of_unequal_cost_add_up_on_their_device():
  forward = np.arange(1.0, S + 1)
  costs = sp.sim.StageCosts(forward=tuple(forward),
                            backward=tuple(2 * forward))
  s = sp.schedules.make("interleaved-1f1b", num_stages=S, num_microbatches=M,
                        num_devices=P)
  r = sp.sim.simulate(s, sp.sim.Cluster.grid(1, P), costs)
  per_stage = M * 3 * forward  # each chunk: M forwards and M backwards
  np.testing.assert_allclose(r.busy[0], per_stage)
  np.testing.assert_allclose(r.device_busy[0],
                             [per_stage[d::P].sum() for d in range(P)])
  np.testing.assert_allclose(r.device_busy + r.device_wait + r.device_delayed
                             + r.device_idle, r.makespan)


@pytest.mark.parametrize("name,kw,micro,B", DEVICE_LEVEL)
def test_engine_equals_reference_with_policies_and_stragglers(name, kw, micro,
                                                              B):
  s = sp.schedules.make(name, num_stages=S, num_microbatches=micro,
                        num_minibatches=B, **kw)
  c, costs = random_cluster(B, N=3), random_costs(B)
  hete = [sp.sim.Stragglers(0.3, 0.7), sp.sim.hete("A")]
  gated = (lambda: sp.sim.wsp(1, 2)) if micro > 1 else (
      lambda: sp.sim.local_sgd(2))  # PipeDream's staleness outruns WSP's D
  for policy in (sp.sim.bsp, sp.sim.ad_psgd, gated):
    fast = sp.sim.simulate(s, c, costs, policy(), perturbations=hete, seed=1)
    slow = reference.simulate(s, c, costs, policy(), perturbations=hete,
                              seed=1)
    assert_same(fast, slow)
    np.testing.assert_allclose(fast.device_busy, slow.device_busy, rtol=1e-12)


def test_bsp_syncs_each_chunk_over_its_devices_links():
  """Two pipelines on two nodes: each chunk all-reduces its own parameter
  bytes across them, over the inter-node link."""
  costs = random_costs(0)
  s = sp.schedules.make("zb-v", num_stages=S, num_microbatches=M)
  c = sp.sim.Cluster.grid(2, P, devices_per_node=P, inter=sp.sim.Link(1e9, 0.01))
  r = sp.sim.simulate(s, c, costs, sp.sim.bsp())
  seconds = {s_: float(e.end[0] - e.start[0]) for s_, e in r.comm}
  assert sorted(seconds) == list(range(S))
  for stage, got in seconds.items():
    assert got == pytest.approx(sp.sim.ring_allreduce_seconds(
        costs.param_bytes[stage], 2, c.inter))


def test_a_straggler_sleeps_once_a_device_and_minibatch():
  s = sp.schedules.make("interleaved-1f1b", num_stages=S, num_microbatches=M,
                        num_minibatches=3, num_devices=P)
  r = sp.sim.simulate(s, sp.sim.Cluster.grid(2, P), unit_costs(UNIT),
                      perturbations=[sp.sim.Stragglers(1.0, 0.5)])
  np.testing.assert_array_equal(r.device_delayed, np.full((2, P), 3 * 0.5))
  assert (r.sleep > 0).sum() == 2 * P * 3


@pytest.mark.parametrize("stages,devices,costs,message", [
    (S, S, S, r"^cluster has 8 stages \(devices a pipeline\); valid: 4, the "
     r"devices of device-level schedule 'zb-v' \(8 stages, v placement\)$"),
    (S, 2, S, r"^cluster has 2 stages \(devices a pipeline\); valid: 4, "),
    (S, P, P, r"^costs has 4 stages; valid: one per stage of schedule "
     r"'zb-v', 8$"),
    (P, S, P, r"^cluster has 8 stages \(devices a pipeline\); valid: 4, those "
     r"of schedule '1f1b'$"),
])
def test_refuses_a_cluster_or_costs_of_the_wrong_size(stages, devices, costs,
                                                     message):
  if stages == S:
    s = sp.schedules.make("zb-v", num_stages=S, num_microbatches=M)
  else:
    s = sp.schedules.make("1f1b", num_stages=P, num_microbatches=M)
  with pytest.raises(ValueError, match=message) as e:
    sp.sim.simulate(s, sp.sim.Cluster.grid(1, devices),
                    sp.sim.StageCosts.uniform(costs))
  assert "\n" not in str(e.value)


def test_refuses_grouping_by_arrival():
  s = sp.schedules.make("zb-v", num_stages=S, num_microbatches=M)
  with pytest.raises(ValueError, match=r"^sync policy 'sdpipe' groups workers "
                     r"across iterations, which is not timed for device-level "
                     r"schedule 'zb-v'; valid: a stage-level one$"):
    sp.sim.simulate(s, sp.sim.Cluster.grid(2, P), unit_costs(SPLIT),
                    sp.sim.sdpipe(2, 0.1, grouping="arrival"))
