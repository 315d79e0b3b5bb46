"""Tests for stalepipe.sim against closed forms and brute-force renderings."""

import itertools
import json

import numpy as np
import pytest

import sdpipe_oracle
import stalepipe as sp
from stalepipe.sim import policy as policy_lib
from stalepipe.sync import grouping
from stalepipe.sim import wsp_sync

FREE = sp.sim.Link(bandwidth=1e12, latency=0.0)  # links that cost nothing
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("pipedream", {}), ("2bw", {}),
             ("hetpipe", {"concurrent_minibatches": 3}), ("timeprest", {}),
             ("zb-h1", {}), ("zb-h2", {}), ("zb-async", {})]
SPLIT = ("zb-h1", "zb-h2", "zb-async")


def free_cluster(num_pipelines, num_stages, **kwargs):
  return sp.sim.Cluster.grid(num_pipelines, num_stages, intra=FREE,
                             inter=FREE, ps=FREE, **kwargs)


def make(name, S, M, B, **kw):
  return sp.schedules.make(name, num_stages=S, num_microbatches=M,
                           num_minibatches=B, **kw)


@pytest.mark.parametrize("name,kw", SCHEDULES)
@pytest.mark.parametrize("S,M,B", [(4, 4, 5), (3, 1, 6)])
def test_unit_costs_reproduce_schedule(name, kw, S, M, B):
  if name in ("2bw", "zb-async") and M < S:
    M = S
  s = make(name, S, M, B, **kw)
  # TiMePReSt's one backward covers M micro-batches: 1/M each is one tick.
  backward = 1.0 / M if s.backward_covers_minibatch else 1.0
  # A split backward: one tick of input gradient, one of weight gradient.
  costs = (sp.sim.StageCosts.uniform(S, 1.0, 2.0, weight_gradient=1.0)
           if name in SPLIT else sp.sim.StageCosts.uniform(S, 1.0, backward))
  r = sp.sim.simulate(s, free_cluster(1, S), costs)
  assert r.makespan == pytest.approx(s.num_ticks)
  assert r.idle.sum() / (S * r.makespan) == pytest.approx(s.bubble_fraction)
  for k, t in enumerate(s.tasks):
    assert r.start[k, 0] == pytest.approx(t.tick)
  expected = np.zeros((B, S), int)
  for t in s.tasks:
    if t.kind != "F":
      expected[t.minibatch, t.stage] = max(
          expected[t.minibatch, t.stage], t.minibatch - s.task_version(t))
  np.testing.assert_array_equal(r.staleness[0], expected)


@pytest.mark.parametrize("S,M,B", [(4, 4, 3), (2, 5, 2), (1, 3, 4)])
def test_gpipe_closed_form(S, M, B):
  tf, tb = 0.3, 0.7
  s = make("gpipe", S, M, B)
  r = sp.sim.simulate(s, free_cluster(1, S),
                      sp.sim.StageCosts.uniform(S, tf, tb))
  assert r.makespan == pytest.approx(B * (M + S - 1) * (tf + tb))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-async"])
@pytest.mark.parametrize("tf,tb,tw", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5),
                                      (1.0, 1.5, 0.5), (1.0, 1.2, 0.8)])
@pytest.mark.parametrize("S,M", [(3, 6), (4, 8), (5, 12)])
def test_zero_bubble_steady_idle_matches_table_2(name, tf, tb, tw, S, M):
  """Idle time per stage and minibatch between updates in the steady state,
  with T_B the input gradient and T_W the weight gradient (Qi et al, Table
  2); the asynchronous schedule has none (no flush)."""
  B = 8
  s = make(name, S, M, B)
  costs = sp.sim.StageCosts.uniform(S, tf, tb + tw, weight_gradient=tw)
  r = sp.sim.simulate(s, free_cluster(1, S), costs)
  period = (r.applied[:, B - 2].max() - r.applied[:, 2].max()) / (B - 4)
  want = (0.0 if name == "zb-async" else
          sp.theory.zero_bubble_bubble_size(name, S, tf, tb, tw))
  assert period - M * (tf + tb + tw) == pytest.approx(want)


def test_split_costs():
  c = sp.sim.StageCosts((1.0, 2.0), (3.0, 4.0), weight_gradient=(1.0, 0.0))
  seconds = {k: [c.seconds(sp.schedules.kinds.kind(k), s) for s in range(2)]
             for k in ("F", "B", "FB", "BI", "BW")}
  assert seconds == {"F": [1.0, 2.0], "B": [3.0, 4.0], "FB": [4.0, 6.0],
                     "BI": [2.0, 4.0], "BW": [1.0, 0.0]}
  with pytest.raises(ValueError, match=r"weight_gradient=5.0 of stage 1 is "
                     r"invalid; it must be in \[0, backward=4.0\]"):
    sp.sim.StageCosts((1.0, 2.0), (3.0, 4.0), weight_gradient=(1.0, 5.0))


def test_heterogeneous_speeds_flow_shop_and_bottleneck():
  S, M = 4, 6
  speed = np.array([1.0, 0.5, 2.0, 0.8])
  tf, tb = np.array([1.0, 1.0, 2.0, 0.5]), np.array([2.0, 1.5, 3.0, 1.0])
  devices = (tuple(sp.sim.Device(speed=v) for v in speed),)
  cluster = sp.sim.Cluster(devices, intra=FREE, inter=FREE, ps=FREE)
  costs = sp.sim.StageCosts(tuple(tf), tuple(tb))
  f, b = tf / speed, tb / speed
  # GPipe, one minibatch: a flow shop of M identical jobs per direction.
  r = sp.sim.simulate(make("gpipe", S, M, 1), cluster, costs)
  assert r.makespan == pytest.approx(f.sum() + (M - 1) * f.max()
                                     + b.sum() + (M - 1) * b.max())
  # Asynchronous 1F1B in steady state: one micro-batch per bottleneck period.
  s = sp.sim.tile(make("pipedream", S, M, 12), 60)
  r = sp.sim.simulate(s, cluster, costs)
  t = r.applied[:, 1:].max(axis=(0, 2))
  np.testing.assert_allclose(np.diff(t[20:50]), M * (f + b).max())


@pytest.mark.parametrize("same_node", [True, False])
def test_link_costs_add(same_node):
  intra = sp.sim.Link(bandwidth=2e6, latency=0.01)
  inter = sp.sim.Link(bandwidth=5e5, latency=0.02)
  cluster = sp.sim.Cluster.grid(1, 2, devices_per_node=2 if same_node else 1,
                                intra=intra, inter=inter)
  costs = sp.sim.StageCosts((1.0, 2.0), (3.0, 4.0),
                            activation_bytes=(1e6, 0.0))
  r = sp.sim.simulate(make("gpipe", 2, 1, 1), cluster, costs)
  link = intra if same_node else inter
  hop = link.latency + 1e6 / link.bandwidth
  assert r.makespan == pytest.approx(1.0 + hop + 2.0 + 4.0 + hop + 3.0)


@pytest.mark.parametrize("N,per_node", [(4, 4), (3, 1)])
def test_bsp_matches_ring_formula(N, per_node):
  link = sp.sim.Link(bandwidth=1e8, latency=1e-3)
  cluster = sp.sim.Cluster.grid(N, 1, devices_per_node=per_node, intra=link,
                                inter=link)
  nbytes, B = 4e8, 3
  costs = sp.sim.StageCosts.uniform(1, 0.5, 1.0, param_bytes=nbytes)
  r = sp.sim.simulate(make("gpipe", 1, 1, B), cluster, costs, sp.sim.bsp())
  ring = 2 * (N - 1) / N * nbytes / 1e8 + 2 * (N - 1) * 1e-3
  assert r.makespan == pytest.approx(B * (1.5 + ring))
  assert r.wait.sum() == pytest.approx(N * (B - 1) * ring)
  assert (r.staleness == 0).all()


def test_parameter_server_fifo_and_ad_psgd_pairs():
  arrivals = np.array([3.0, 0.0, 0.5, 10.0])
  finish, t = {}, -np.inf
  for k in np.argsort(arrivals, kind="stable"):
    t = max(t, arrivals[k]) + 2.0
    finish[k] = t
  np.testing.assert_allclose(policy_lib.fifo(arrivals, 2.0),
                             [finish[k] for k in range(4)])
  N, B = 6, 4
  link = sp.sim.Link(bandwidth=1e6, latency=0.0)
  cluster = sp.sim.Cluster.grid(N, 1, intra=link, inter=link, ps=link)
  costs = sp.sim.StageCosts.uniform(1, 1.0, 1.0, param_bytes=1e6)
  r = sp.sim.simulate(make("gpipe", 1, 1, B), cluster, costs,
                      sp.sim.parameter_server())
  ready = np.full(N, 2.0)  # one push or pull takes 1 s; compute takes 2 s
  for _ in range(B):
    server = -np.inf
    for k in np.argsort(ready, kind="stable"):
      server = max(server, ready[k]) + 1.0
    pulled = server + 1.0 + np.arange(N)  # pulls served in pipeline order
    ready = pulled + 2.0
  assert r.makespan == pytest.approx(pulled.max())
  own = sp.sim.Cluster.grid(N, 1, intra=link, inter=link, ps=link,
                            ps_shared=False)
  r = sp.sim.simulate(make("gpipe", 1, 1, B), own, costs,
                      sp.sim.parameter_server())
  assert r.makespan == pytest.approx(B * (2.0 + 2 * 1.0))
  r = sp.sim.simulate(make("gpipe", 1, 1, B), cluster, costs,
                      sp.sim.ad_psgd(), seed=3)
  assert r.makespan == pytest.approx(B * (2.0 + 1.0))  # ring of 2: b/beta
  assert all(len(e.pipelines) == N for _, e in r.comm)


def required_wave_brute(q, n_m, d):
  """Seed 001 §5 (1-based p = q + 1): p needs all updates of 1..p-(s_g+1)."""
  s_global = (d + 1) * n_m + n_m - 2
  last = q + 1 - (s_global + 1)  # 1-based minibatch
  return -1 if last < 1 else (last - 1) // n_m


def test_wsp_required_wave_matches_global_staleness():
  for q, n_m, d in itertools.product(range(40), (1, 2, 4), (0, 1, 3)):
    assert wsp_sync.required_wave(q, n_m, d) == required_wave_brute(q, n_m, d)
    assert (sp.theory.wsp_global_staleness(d, n_m - 1)
            == (d + 1) * n_m + n_m - 2)


@pytest.mark.parametrize("D", [0, 1, 2])
def test_wsp_clock_distance_never_exceeds_d(D):
  N, S, n_m, B = 4, 3, 3, 60
  s = make("hetpipe", S, 1, B, concurrent_minibatches=n_m)
  speeds = [1.0, 0.7, 1.3, 0.9]
  devices = tuple(tuple(sp.sim.Device(speed=v, node=i) for _ in range(S))
                  for i, v in enumerate(speeds))
  cluster = sp.sim.Cluster(devices, intra=FREE, inter=FREE,
                           ps=sp.sim.Link(1e8, 1e-3))
  costs = sp.sim.StageCosts.uniform(S, 0.1, 0.2, param_bytes=1e6)
  r = sp.sim.simulate(s, cluster, costs, sp.sim.wsp(D, n_m),
                      perturbations=[sp.sim.Stragglers(0.3, 0.5)], seed=D)
  clocks = r.extras["wsp_clock_times"]  # [N, waves]
  assert np.isfinite(clocks).all()
  for t in np.unique(clocks):
    reached = (clocks <= t).sum(axis=1)
    assert reached.max() - reached.min() <= D
  # Every minibatch starts only after the global wave it must read.
  visible = r.extras["wsp_global_visible"]
  for k, task in enumerate(s.tasks):
    w = required_wave_brute(task.minibatch, n_m, D)
    if w >= 0:
      assert (r.start[k] >= visible[task.stage, w] - 1e-12).all()


def test_stragglers_p0_change_nothing_p1_add_d_per_iteration():
  S, M, B, N, d = 3, 2, 5, 3, 0.25
  s = make("gpipe", S, M, B)
  cluster = free_cluster(N, S)
  costs = sp.sim.StageCosts.uniform(S, 0.1, 0.2)
  base = sp.sim.simulate(s, cluster, costs, sp.sim.bsp())
  none = sp.sim.simulate(s, cluster, costs, sp.sim.bsp(),
                         perturbations=[sp.sim.Stragglers(0.0, d)])
  np.testing.assert_array_equal(base.end, none.end)
  every = sp.sim.simulate(s, cluster, costs, sp.sim.bsp(),
                          perturbations=[sp.sim.Stragglers(1.0, d)])
  added = every.applied[:, 1:] - base.applied[:, 1:]
  np.testing.assert_allclose(
      added, np.broadcast_to(d * np.arange(1, B + 1)[None, :, None],
                             added.shape))


def test_trace_replay_and_seeds(tmp_path):
  S, N, B = 2, 2, 4
  s = make("1f1b", S, 2, B)
  cluster = free_cluster(N, S)
  costs = sp.sim.StageCosts.uniform(S, 0.1, 0.2)
  doubled = np.full((2, N * S), 2.0)  # replayed cyclically over 4 iterations
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(doubled.tolist()))
  slow = sp.sim.simulate(s, cluster, costs,
                         perturbations=[sp.sim.load_trace(str(path))])
  fast = sp.sim.simulate(s, cluster, costs)
  assert slow.makespan == pytest.approx(2 * fast.makespan)
  delays = np.random.default_rng(0).random((B, N * S))
  np.save(tmp_path / "d.npy", delays)
  r = sp.sim.simulate(s, cluster, costs, perturbations=[
      sp.sim.load_trace(str(tmp_path / "d.npy"), kind="delay")])
  np.testing.assert_allclose(r.busy, fast.busy)
  np.testing.assert_allclose(r.delayed, delays.reshape(B, N, S).sum(0))
  hete = [sp.sim.hete("B")]
  one = sp.sim.simulate(s, cluster, costs, sp.sim.ad_psgd(),
                        perturbations=hete, seed=7)
  two = sp.sim.simulate(s, cluster, costs, sp.sim.ad_psgd(),
                        perturbations=hete, seed=7)
  other = sp.sim.simulate(s, free_cluster(N, S), costs, sp.sim.ad_psgd(),
                          perturbations=[sp.sim.Stragglers(0.5, 0.3)], seed=8)
  np.testing.assert_array_equal(one.end, two.end)
  assert not np.array_equal(one.end, other.end)


def test_window_groups_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(50):
    ready = rng.random(7)
    window = rng.random() * 0.5
    groups, starts = grouping.window_groups(ready, window)
    left, expected = set(range(7)), []
    while left:
      t0 = min(ready[i] for i in left)
      g = {i for i in left if ready[i] <= t0 + window}
      expected.append(g)
      left -= g
    assert [set(g.tolist()) for g in groups] == expected
    for g, t in zip(groups, starts):
      assert t >= ready[g].max()


@pytest.mark.parametrize("min_size", [1, 2, 3, 5])
def test_window_groups_follow_algorithm_2_with_the_adaptive_timeout(min_size):
  rng = np.random.default_rng(min_size)
  for _ in range(200):
    n = int(rng.integers(1, 12))
    ready = np.round(rng.random(n), 1 if rng.random() < 0.3 else 6)  # ties
    window = float(rng.choice([0.0, rng.random() * 0.3, np.inf]))
    groups, starts = grouping.window_groups(ready, window, min_size)
    want_groups, want_starts = sdpipe_oracle.algorithm2(ready, window,
                                                        min_size)
    assert [g.tolist() for g in groups] == want_groups
    assert starts == want_starts


def test_sdpipe_options_are_checked_on_both_sides():
  with pytest.raises(ValueError, match="min_size=0 is invalid; it must be an "
                     "integer >= 1"):
    sp.sim.sdpipe(10, 0.01, min_size=0)
  with pytest.raises(ValueError, match="min_size=1.5 is invalid"):
    sp.sync.sdpipe(4, 10, 0.01, min_size=1.5)
  with pytest.raises(ValueError, match="history=0 is invalid"):
    sp.sync.sdpipe(4, 0)
  with pytest.raises(ValueError, match="window=-1 is invalid"):
    sp.sim.sdpipe(10, -1)
  with pytest.raises(ValueError, match="history_unit='groups' is invalid; "
                     "valid: iteration, group"):
    sp.sync.sdpipe(4, history_unit="groups")


def connected_bfs(n, groups):
  adjacent = {i: set() for i in range(n)}
  for g in groups:
    for a, b in itertools.combinations(g, 2):
      adjacent[a].add(b)
      adjacent[b].add(a)
  seen, frontier = {0}, [0]
  while frontier:
    nxt = [b for a in frontier for b in adjacent[a] if b not in seen]
    seen.update(nxt)
    frontier = nxt
  return len(seen) == n


@pytest.mark.parametrize("S,P", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_sdpipe_sync_graph_connected_over_p_iterations(S, P):
  N, B = 6, 40
  s = make("1f1b", S, 2, B)
  cluster = free_cluster(N, S)
  costs = sp.sim.StageCosts.uniform(S, 0.1, 0.2, param_bytes=1e6)
  hete = [sp.sim.Stragglers(0.3, 0.3)]
  r = sp.sim.simulate(s, cluster, costs, sp.sim.sdpipe(P, 0.01),
                      perturbations=hete, seed=1)
  skipped = set(r.extras["sdpipe_skipped"])
  if S == 1:  # nothing to deadlock with
    assert not skipped
  for stage, stage_groups in enumerate(r.extras["sdpipe_groups"]):
    assert len(stage_groups) == B
    for k in range(B - P + 1):
      if not skipped & {(stage, j) for j in range(k, k + P)}:
        window = [g.tolist() for it in stage_groups[k:k + P] for g in it]
        assert connected_bfs(N, window)
  every = sp.sim.simulate(s, cluster, costs, sp.sim.sdpipe(P, np.inf),
                          perturbations=hete, seed=1)
  bsp = sp.sim.simulate(s, cluster, costs, sp.sim.bsp(), perturbations=hete,
                        seed=1)
  np.testing.assert_allclose(every.end, bsp.end)


def test_timeline_covers_busy_and_waits():
  s = make("1f1b", 2, 2, 3)
  cluster = free_cluster(2, 2)
  costs = sp.sim.StageCosts.uniform(2, 0.1, 0.2, param_bytes=1e6,
                                    update=(0.05, 0.05))
  r = sp.sim.simulate(s, cluster, costs, sp.sim.bsp(),
                      perturbations=[sp.sim.Stragglers(0.5, 0.3)])
  assert r.delayed.sum() > 0
  events = r.timeline()
  busy, wait, slept = (np.zeros((2, 2)) for _ in range(3))
  for e in events:
    i, s_ = int(e.row.split()[1]), int(e.row.split()[3])
    if e.kind in ("F", "B", "FB", "U"):
      busy[i, s_] += e.duration
    elif e.kind == "W":
      (slept if e.label == "sleep" else wait)[i, s_] += e.duration
  np.testing.assert_allclose(busy, r.busy)
  np.testing.assert_allclose(wait, r.wait)
  np.testing.assert_allclose(slept, r.delayed)
  np.testing.assert_allclose(r.busy + r.wait + r.delayed + r.idle, r.makespan)
  per_device = {}
  for e in sorted(events, key=lambda e: e.start):
    if e.kind != "C":  # a device does one thing at a time
      assert e.start >= per_device.get(e.row, 0.0) - 1e-9
      per_device[e.row] = e.start + e.duration


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="probability"):
    sp.sim.Stragglers(1.5, 0.1)
  with pytest.raises(ValueError, match="stages"):
    sp.sim.simulate(make("gpipe", 2, 1, 1), free_cluster(1, 3),
                    sp.sim.StageCosts.uniform(2))
  with pytest.raises(ValueError, match="clock_distance"):
    sp.sim.wsp(-1, 4)


@pytest.mark.parametrize("name,kw", SCHEDULES)
@pytest.mark.parametrize("S,M", [(3, 3), (4, 1)])
def test_tile_equals_building_directly(name, kw, S, M):
  if name in ("2bw", "zb-async") and M < S:
    M = S
  short = make(name, S, M, 3 * S + 6, **kw)
  tiled = sp.sim.tile(short, 31)
  direct = short.with_minibatches(31)
  assert tiled.tasks == direct.tasks
  assert dict(tiled.versions) == dict(direct.versions)


def test_local_sgd_and_memory():
  N, B, H = 3, 7, 3
  link = sp.sim.Link(bandwidth=1e6, latency=0.0)
  cluster = sp.sim.Cluster.grid(N, 1, intra=link, inter=link)
  costs = sp.sim.StageCosts.uniform(1, 1.0, 1.0, param_bytes=3e6)
  r = sp.sim.simulate(make("gpipe", 1, 1, B), cluster, costs,
                      sp.sim.local_sgd(H))
  ring = 2 * (N - 1) / N * 3.0
  assert r.makespan == pytest.approx(B * 2.0 + (B // H) * ring)
  s = make("pipedream", 3, 2, 6)
  costs = sp.sim.StageCosts.uniform(3, param_bytes=100.0,
                                    activation_bytes=(10.0, 20.0, 30.0))
  need = [100.0 * d + a * f for d, a, f in
          zip(s.stash_depth, (10.0, 20.0, 30.0), s.max_in_flight)]
  small = sp.sim.Device(memory_bytes=min(need))
  cluster = sp.sim.Cluster(((small,) * 3,), intra=FREE, inter=FREE)
  r = sp.sim.simulate(s, cluster, costs)
  np.testing.assert_allclose(r.memory_required, need)
  np.testing.assert_array_equal(r.fits[0], np.array(need) <= min(need))
