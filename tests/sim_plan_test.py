"""One vocabulary from planner to simulator, one policy for both planes."""

import numpy as np
import pytest

import stalepipe as sp
from stalepipe.plan import analytic
from stalepipe.plan import devices as dev

BATCH = 32


def profiles(model):
  """Seed 001's analytic profiles, calibrated as the HetPipe experiments."""
  blocks = analytic.MODELS[model]()
  efficiency = {"vgg19": 159.0, "resnet152": 112.0}[model] * (
      analytic.training_flops(blocks) / (dev.TITAN_V.tflops * 1e12))
  usable = lambda t: t._replace(memory_bytes=t.memory_bytes - dev.GIB // 2)
  return {t.name: analytic.profile(blocks, usable(t), BATCH, efficiency)
          for t in dev.TABLE1.values()}, usable


def hand_glued_cluster_plan(plans, ps_local):
  """How plan_hetpipe.py built the simulator's cluster by hand (b59b6f4)."""
  k = len(plans[0].devices)
  costs = sp.sim.StageCosts(
      forward=(1.0,) * k, backward=(2.0,) * k,
      activation_bytes=tuple(max(p.activation_bytes[s] for p in plans)
                             for s in range(k)),
      param_bytes=tuple(max(p.param_bytes[s] for p in plans)
                        for s in range(k)),
      samples_per_microbatch=BATCH)
  rows = tuple(tuple(sp.sim.Device(name=d.spec.name, speed=1.0 / f,
                                   memory_bytes=d.spec.memory_bytes,
                                   node=d.node)
                     for d, f in zip(p.devices, p.forward_s)) for p in plans)
  net = dev.HETPIPE_NETWORK
  intra = sp.sim.Link(net.intra_bandwidth, net.intra_latency)
  inter = sp.sim.Link(net.inter_bandwidth, net.inter_latency)
  return sp.sim.Cluster(rows, intra=intra, inter=inter,
                        ps=intra if ps_local else inter), costs


def hand_glued_plan(plan, workers):
  """How sim_hetpipe_table4.py built it from one partition (b59b6f4)."""
  rows = tuple(tuple(sp.sim.Device(d.spec.name, 1.0, d.spec.memory_bytes,
                                   d.node) for d in plan.devices)
               for _ in range(workers))
  cluster = sp.sim.Cluster(rows, intra=sp.sim.Link(15.75e9, 10e-6),
                           inter=sp.sim.Link(56e9 / 8, 20e-6),
                           ps=sp.sim.Link(15.75e9, 10e-6), ps_shared=False)
  costs = sp.sim.StageCosts(plan.forward_s, plan.backward_s,
                            activation_bytes=plan.activation_bytes,
                            param_bytes=plan.param_bytes,
                            samples_per_microbatch=BATCH)
  return cluster, costs


def hetpipe(stages, concurrent, minibatches=None):
  return sp.schedules.make("hetpipe", num_stages=stages, num_microbatches=1,
                           num_minibatches=minibatches or 8 * concurrent,
                           concurrent_minibatches=concurrent)


@pytest.mark.parametrize("model,policy,ps_local", [
    ("vgg19", "NP", False), ("vgg19", "HD", False), ("resnet152", "ED", True)])
def test_cluster_plan_simulates_as_the_hand_glue(model, policy, ps_local):
  """Table 3's setting: a ClusterPlan in one call, against plan_hetpipe.py's
  former glue (reference costs 1 and 2, speed 1 / forward seconds)."""
  table, usable = profiles(model)
  nodes = sp.plan.Cluster(tuple(sp.plan.Node(usable(dev.TABLE1[t]), 4)
                                for t in "VRGQ"))
  planned = sp.plan.plan_cluster(nodes, policy, table, concurrent=2, limit=4)
  schedule = hetpipe(4, 2)
  wsp = sp.sync.wsp(4, clock_distance=0, concurrent_minibatches=2)
  ours = sp.sim.simulate(schedule, *sp.sim.from_plan(
      planned, ps="intra" if ps_local else "inter",
      samples_per_microbatch=BATCH), wsp)
  glued = sp.sim.simulate(schedule, *hand_glued_cluster_plan(
      planned.plans, ps_local), sp.sim.wsp(0, 2))
  np.testing.assert_allclose(ours.end, glued.end, rtol=1e-12)
  assert ours.steady_samples_per_second(4) == pytest.approx(
      glued.steady_samples_per_second(4), rel=1e-12)
  # Every stage of every worker takes exactly its planned seconds.
  for i, p in enumerate(planned.plans):
    for k, t in enumerate(schedule.tasks[:8]):
      want = p.forward_s[t.stage] + (p.backward_s[t.stage]
                                     if t.kind == "FB" else 0.0)
      if t.kind in ("F", "FB"):
        assert ours.end[k, i] - ours.start[k, i] == pytest.approx(want)


def test_one_plan_simulates_as_the_hand_glue():
  """Table 4's setting (ED-local, 16 [VRQG]): bit for bit."""
  table, usable = profiles("vgg19")
  vw = [dev.Device(usable(dev.TABLE1[t]), i, 0) for i, t in enumerate("VRQG")]
  plan = sp.plan.partition(table, vw, concurrent=5)
  schedule = hetpipe(4, 5, 60)
  ours = sp.sim.simulate(schedule, *sp.sim.from_plan(
      plan, num_pipelines=4, ps="intra", ps_shared=False,
      samples_per_microbatch=BATCH),
                         sp.sync.wsp(4, clock_distance=0,
                                     concurrent_minibatches=5))
  glued = sp.sim.simulate(schedule, *hand_glued_plan(plan, 4),
                          sp.sim.wsp(0, 5))
  np.testing.assert_array_equal(ours.end, glued.end)
  assert ours.makespan == glued.makespan


def test_table1_and_the_network_are_data_in_one_vocabulary():
  assert sp.sim.Link is sp.plan.Link
  assert sp.sim.Cluster.grid(1, 2).intra == dev.HETPIPE_NETWORK.intra
  assert dev.HETPIPE_NETWORK.inter == sp.plan.Link(56e9 / 8, 20e-6)
  # Seed 001 Table 1: TITAN V 5120 cores at 1455 MHz, 12 GB.
  assert dev.TABLE1["V"].tflops == pytest.approx(2 * 5120 * 1455e6 / 1e12)
  d = sp.sim.Device.of(dev.Device(dev.TABLE1["G"], node=3, slot=1), 0.5)
  assert (d.name, d.node, d.speed, d.memory_bytes) == ("G", 3, 0.5, 6 * dev.GIB)


def test_from_plan_refuses_what_one_cost_table_cannot_hold():
  p = sp.plan.Profile("V", 1, (1., 1.), (2., 2.), (8, 8), (8, 8), (8, 8))
  q = p.__class__(**{**p.__dict__, "backward_s": (3., 3.)})
  devices = [dev.Device(dev.TITAN_V, 0, k) for k in range(2)]
  one = sp.plan.partition({"V": p}, devices)
  other = sp.plan.partition({"V": q}, devices)
  planned = sp.plan.ClusterPlan((devices, devices), (1, 1), 1, (one, other))
  with pytest.raises(ValueError, match="backward/forward 3 against worker "
                     "0's 2"):
    sp.sim.from_plan(planned)
  with pytest.raises(ValueError, match="ps='local' is invalid; valid: inter, "
                     "intra"):
    sp.sim.from_plan(one, ps="local")
  with pytest.raises(ValueError, match="num_pipelines=2 is invalid for a "
                     "ClusterPlan"):
    sp.sim.from_plan(planned, num_pipelines=2)


POLICIES = [  # (the sync policy, the same policy's time-only form)
    (lambda n: sp.sync.bsp(n), lambda: sp.sim.bsp()),
    (lambda n: sp.sync.wsp(n, clock_distance=1, concurrent_minibatches=2),
     lambda: sp.sim.wsp(1, 2)),
    (lambda n: sp.sync.sdpipe(n, history=3, window=0.01),
     lambda: sp.sim.sdpipe(3, 0.01)),
    (lambda n: sp.sync.sdpipe(n, history=3, window=0.0, enforce=False),
     lambda: sp.sim.sdpipe(3, 0.0, enforce=False)),
    (lambda n: sp.sync.local_sgd(n, period=3), lambda: sp.sim.local_sgd(3)),
]


@pytest.mark.parametrize("index", range(len(POLICIES)))
def test_a_sync_policy_times_as_its_time_side(index):
  numeric, timed = POLICIES[index]
  N, S = 5, 2
  name = "hetpipe" if index == 1 else "1f1b"
  s = sp.schedules.make(name, num_stages=S, num_microbatches=2,
                        num_minibatches=24,
                        **({"concurrent_minibatches": 2} if index == 1 else {}))
  cluster = sp.sim.Cluster.grid(N, S, devices_per_node=2)
  costs = sp.sim.StageCosts.uniform(S, 0.01, 0.02, param_bytes=1e7)
  hete = [sp.sim.hete("B")]
  a = sp.sim.simulate(s, cluster, costs, numeric(N), perturbations=hete)
  b = sp.sim.simulate(s, cluster, costs, timed(), perturbations=hete)
  np.testing.assert_array_equal(a.end, b.end)
  np.testing.assert_array_equal(a.staleness, b.staleness)
  assert a.policy == b.policy


def test_ad_psgd_pairs_in_time_as_in_numbers():
  N, S, B = 6, 3, 10
  policy = sp.sync.ad_psgd(N, seed=4)
  s = sp.schedules.make("gpipe", num_stages=S, num_microbatches=1,
                        num_minibatches=B)
  r = sp.sim.simulate(s, sp.sim.Cluster.grid(N, S), sp.sim.StageCosts.uniform(
      S, param_bytes=1e6), policy)
  syncs = iter(r.comm)  # one exchange per update, in the order of updates
  for task in s.tasks:
    if task.kind == "B":
      stage, event = next(syncs)
      mixing = sp.sync.group_mixing(event.pipelines.reshape(-1, 2), N)
      np.testing.assert_array_equal(mixing,
                                    policy.mixing(stage, task.minibatch))


@pytest.mark.parametrize("min_size", [1, 3])
def test_sdpipe_replays_the_simulated_groups(min_size):
  """SDPipe named once: the simulator's ready times drive the numeric side's
  scheduler to the groups the simulator formed."""
  N, B = 7, 30
  s = sp.schedules.make("1f1b", num_stages=1, num_microbatches=2,
                        num_minibatches=B)
  cluster = sp.sim.Cluster.grid(N, 1)
  costs = sp.sim.StageCosts.uniform(1, 0.01, 0.02, param_bytes=1e7)
  timed = sp.sync.sdpipe(N, history=2, window=0.02, min_size=min_size)
  r = sp.sim.simulate(s, cluster, costs, timed,
                      perturbations=[sp.sim.Stragglers(0.3, 0.05)])
  replayed = sp.sync.sdpipe(N, history=2, window=0.02,
                            ready_times=r.ready_times, min_size=min_size)
  sizes = [len(g) for groups in r.extras["sdpipe_groups"][0]
           for g in list(groups)[:-1]]  # an iteration's last takes who is left
  assert min(sizes) >= min_size and (min_size > 1 or min(sizes) == 1)
  for p in range(B):
    np.testing.assert_array_equal(
        replayed.mixing(0, p),
        sp.sync.group_mixing(r.extras["sdpipe_groups"][0][p], N))


def test_a_policy_for_other_replicas_is_refused():
  s = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1)
  with pytest.raises(ValueError, match="sync policy 'wsp' has num_replicas=3;"
                     " valid: the cluster's 4 pipelines"):
    sp.sim.simulate(s, sp.sim.Cluster.grid(4, 1), sp.sim.StageCosts.uniform(1),
                    sp.sync.wsp(3, clock_distance=0, concurrent_minibatches=1))
