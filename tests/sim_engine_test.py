"""The fast simulator against the reference one, event for event.

`stalepipe.sim.engine` (compiled index arrays, in-place rows, O(N) staleness,
the vectorised SDPipe scheduler) must reproduce `stalepipe.sim.reference`
(one NumPy step per task, an N x N matrix per stage) and SDPipe's scheduler as
first written (`sdpipe_oracle`: union-find over group lists).
"""

import itertools

import numpy as np
import pytest

import sdpipe_oracle
import stalepipe as sp
from stalepipe.sim import engine
from stalepipe.sim import knowledge
from stalepipe.sim import reference
from stalepipe.sim import sdpipe_sync
from stalepipe.sync import grouping

EXACT = ("start", "end", "ready", "blocked", "sleep_at", "sleep", "applied",
         "staleness", "update_seconds")
POLICIES = {
    "isolated": lambda: sp.sim.isolated(),
    "bsp": lambda: sp.sim.bsp(),
    "local_sgd": lambda: sp.sim.local_sgd(3),
    "parameter_server": lambda: sp.sim.parameter_server(),
    "ad_psgd": lambda: sp.sim.ad_psgd(),
    "sdpipe": lambda: sp.sim.sdpipe(3, 0.01),
    "sdpipe_p1": lambda: sp.sim.sdpipe(1, 0.002),
}
SCHEDULES = [("1f1b", 2, {}), ("gpipe", 2, {}), ("pipedream", 3, {}),
             ("2bw", 3, {}), ("zb-h1", 3, {}), ("zb-async", 3, {}),
             ("timeprest", 2, {}), ("hetpipe", 1, {"concurrent_minibatches": 3})]


def cluster(N, S):
  return sp.sim.Cluster.grid(N, S, devices_per_node=4,
                             inter=sp.sim.Link(2e9, 1e-4),
                             ps=sp.sim.Link(1e9, 1e-4))


def schedule(name, S, M, B, **kw):
  short = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                            num_minibatches=3 * S + 8, **kw)
  return sp.sim.tile(short, B)


def costs(S):
  return sp.sim.StageCosts.uniform(S, 0.01, 0.02, weight_gradient=0.01,
                                   param_bytes=2e6, activation_bytes=1e6,
                                   update=0.001, samples_per_microbatch=4)


def comm(result):
  return sorted((s, int(i), float(a), float(b)) for s, e in result.comm
                for i, a, b in zip(e.pipelines, e.start, e.end))


def groups(result):
  return [[[g.tolist() for g in it] for it in stage]
          for stage in result.extras.get("sdpipe_groups", [])]


def assert_same(fast, slow):
  for field in EXACT:
    np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field),
                                  err_msg=field)
  assert fast.makespan == slow.makespan
  for field in ("busy", "wait", "idle", "delayed"):
    np.testing.assert_allclose(getattr(fast, field), getattr(slow, field),
                               rtol=1e-12, atol=1e-12, err_msg=field)
  np.testing.assert_array_equal(fast.applied_local, slow.applied_local)
  assert comm(fast) == comm(slow)
  assert groups(fast) == groups(slow)
  for key in ("sdpipe_skipped", "wsp_clock_times", "wsp_global_visible"):
    if key in slow.extras:
      np.testing.assert_array_equal(fast.extras[key], slow.extras[key])


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("N", [1, 3, 6])
def test_engine_equals_reference_for_every_policy(policy, N):
  S = 3
  s = schedule("1f1b", S, 2, 40)
  hete = [sp.sim.hete("B"), sp.sim.Stragglers(0.3, 0.004)]
  fast = sp.sim.simulate(s, cluster(N, S), costs(S), POLICIES[policy](),
                         perturbations=hete, seed=N)
  slow = reference.simulate(s, cluster(N, S), costs(S), POLICIES[policy](),
                            perturbations=hete, seed=N)
  assert_same(fast, slow)


@pytest.mark.parametrize("name,M,kw", SCHEDULES)
@pytest.mark.parametrize("policy", ["ad_psgd", "sdpipe", "wsp"])
def test_engine_equals_reference_for_every_schedule(name, M, kw, policy):
  S, N = 3, 4
  s = schedule(name, S, M, 30, **kw)
  make = (lambda: sp.sim.wsp(2, 3)) if policy == "wsp" else POLICIES[policy]
  speeds = sp.sim.Cluster(tuple(
      tuple(sp.sim.Device(speed=0.5 + 0.25 * ((i + k) % 3), node=i // 2)
            for k in range(S)) for i in range(N)))
  trace = sp.sim.Trace(np.random.default_rng(0).uniform(0.8, 1.5, (7, N * S)))
  for c in (cluster(N, S), speeds):
    fast = sp.sim.simulate(s, c, costs(S), make(),
                           perturbations=[sp.sim.hete("A"), trace], seed=2)
    slow = reference.simulate(s, c, costs(S), make(),
                              perturbations=[sp.sim.hete("A"), trace], seed=2)
    assert_same(fast, slow)


@pytest.mark.parametrize("name,M,kw", SCHEDULES + [("zb-h2", 3, {})])
def test_compiled_schedule_equals_reference(name, M, kw):
  S = 4
  s = schedule(name, S, M, 20, **kw)
  fast = engine.compile_schedule(s, costs(S))
  slow = reference._compile(s, costs(S))  # pylint: disable=protected-access
  for field in slow._fields:
    if getattr(slow, field) is None:  # what only the fast engine uses
      continue
    np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field),
                                  err_msg=field)


class OracleScheduler:
  """Today's union-find scheduler behind the vectorised one's interface."""

  def __init__(self, num_stages, history, window, enforce=True, min_size=1,
               history_unit="iteration"):
    assert (min_size, history_unit) == (1, "iteration")
    self.inner = sdpipe_oracle.Scheduler(num_stages, history, window, enforce)
    self.groups, self.skipped = self.inner.groups, self.inner.skipped

  def decide_many(self, stages, iteration, ready):
    groups, starts = [], []
    for stage, row in zip(stages, ready):
      found, times = self.inner.decide(stage, iteration, row)
      sizes = [len(g) for g in found]
      groups.append(grouping.Groups(np.concatenate(found),
                                    np.concatenate([[0], np.cumsum(sizes)])))
      starts.append(np.array(times))
    return grouping.stacked(groups, starts,
                            np.stack([g.members for g in groups]))


@pytest.mark.parametrize("history,window", [(1, 0.002), (3, 0.004),
                                            (10, 0.01), (4, 0.0)])
def test_sdpipe_run_equals_union_find_scheduler(history, window, monkeypatch):
  S, N = 3, 9
  s = schedule("1f1b", S, 2, 50)
  run = lambda: sp.sim.simulate(
      s, cluster(N, S), costs(S), sp.sim.sdpipe(history, window),
      perturbations=[sp.sim.hete("B")], seed=history)
  fast = run()
  monkeypatch.setattr(sdpipe_sync.grouping_lib, "Scheduler", OracleScheduler)
  slow = run()
  assert_same(fast, slow)
  assert fast.extras["sdpipe_skipped"] == slow.extras["sdpipe_skipped"]


def runs(rng, S):
  """The stages in random order, cut into random runs."""
  order = rng.permutation(S)
  cuts = np.sort(rng.choice(np.arange(1, S), int(rng.integers(0, S)),
                            replace=False)) if S > 1 else []
  return [run.tolist() for run in np.split(order, cuts)]


def decide_alike(rng, make_new, make_old, trials=60, max_workers=12):
  """Two schedulers on the same random ready times, decision for decision:
  each iteration the stages come in random order, the new scheduler given
  them in random runs decided together (`decide_many`; a run of one through
  `decide` or `decide_many`), the old one by one."""
  for trial in range(trials):
    N, S = int(rng.integers(1, max_workers)), int(rng.integers(1, 5))
    history, window = int(rng.integers(1, 6)), float(rng.uniform(0, 0.3))
    new, old = make_new(S, history, window), make_old(S, history, window)
    for k in range(12):
      ready = rng.random((S, N)) + 0.2 * k
      for run in runs(rng, S):
        if len(run) == 1 and rng.random() < 0.5:
          decided = [new.decide(run[0], k, ready[run[0]])]
        else:
          batch = new.decide_many(run, k, ready[run])
          decided = zip(batch.groups, batch.starts)
        for stage, (g_new, t_new) in zip(run, decided):
          g_old, t_old = old.decide(stage, k, ready[stage])
          assert [g.tolist() for g in g_new] == [
              np.asarray(g).tolist() for g in g_old], (trial, k, stage)
          assert np.asarray(t_new).tolist() == t_old
    assert new.skipped == old.skipped


def test_scheduler_decides_as_union_find_on_random_ready_times():
  decide_alike(np.random.default_rng(0), grouping.Scheduler,
               sdpipe_oracle.Scheduler)


@pytest.mark.parametrize("min_size", [2, 3])
def test_scheduler_with_the_adaptive_timeout_decides_as_union_find(
    min_size, monkeypatch):
  """The union-find scheduler over Algorithm 2's event loop with §4's
  growing timeout (`sdpipe_oracle.algorithm2`) decides as
  `grouping.Scheduler`."""
  algorithm2 = sdpipe_oracle.algorithm2
  monkeypatch.setattr(sdpipe_oracle, "window_groups", lambda ready, window: (
      [np.array(g) for g in algorithm2(ready, window, min_size)[0]],
      algorithm2(ready, window, min_size)[1]))
  decide_alike(np.random.default_rng(min_size),
               lambda *a: grouping.Scheduler(*a, min_size=min_size),
               sdpipe_oracle.Scheduler, trials=40)


@pytest.mark.parametrize("min_size", [1, 2])
def test_history_in_group_sync_operations_decides_as_union_find(min_size):
  """P counted in groups (§3.2's clock k): `grouping.Scheduler` against
  `sdpipe_oracle.GroupClockScheduler`, union-find over lists of groups."""
  decide_alike(np.random.default_rng(10 + min_size),
               lambda *a: grouping.Scheduler(*a, min_size=min_size,
                                             history_unit="group"),
               lambda *a: sdpipe_oracle.GroupClockScheduler(*a, min_size),
               trials=40, max_workers=10)


def random_groups(rng, N):
  order = rng.permutation(N)
  cuts = np.sort(rng.choice(np.arange(1, N), int(rng.integers(0, N)),
                            replace=False))
  sizes = np.diff(np.concatenate([[0], cuts, [N]]))
  return grouping.Groups(order, np.concatenate([[0], np.cumsum(sizes)]))


def test_sync_window_components_equal_union_find_over_the_window():
  """Components of each stage's last `size` rows plus one more, as the
  window slides, the stages in random runs taken together, against
  union-find over the same group lists; what is pushed is sometimes not
  what was asked about (a merged row)."""
  rng = np.random.default_rng(1)
  for _ in range(40):
    N, S, size = (int(rng.integers(1, 30)), int(rng.integers(1, 5)),
                  int(rng.integers(0, 6)))
    window, rows = grouping.SyncWindow(S, size, N), [[] for _ in range(S)]
    for _ in range(15):
      for run in runs(rng, S):
        asked = [random_groups(rng, N) for _ in run]
        members = np.stack([g.members for g in asked])
        inner = np.concatenate([g.inner for g in asked])
        joined = window.joined(run, members.ravel() + np.repeat(
            np.arange(len(run)) * N, N), inner)
        comp = window.components(run, joined).reshape(len(run), N)
        for r, (s, groups) in enumerate(zip(run, asked)):
          past = rows[s][max(0, len(rows[s]) - size):] if size else []
          uf = sdpipe_oracle.sync_graph(
              N, [g for row in past + [groups] for g in row])
          assert len(np.unique(comp[r])) == uf.components
          for a, b in itertools.combinations(range(N), 2):
            assert (comp[r, a] == comp[r, b]) == (uf.find(a) == uf.find(b))
        pushed = [random_groups(rng, N) if rng.random() < 0.5 else g
                  for g in asked]
        for r, (g, h) in enumerate(zip(pushed, asked)):
          if g is not h:
            joined[r * N:r * N + N] = window.joined([run[r]], g.members,
                                                    g.inner)
          inner[r * N:r * N + N] = g.inner
          members[r] = g.members
          rows[run[r]].append(g)
        window.push(run, members, inner, joined)


def test_knowledge_equals_the_dense_matrix(monkeypatch):
  """Row sums of know (today's N x N bookkeeping), with floors and reads of
  versions older than the current one; stages given their groups as index
  arrays, `grouping.Groups` and a `[pairs, 2]` array; iteration by
  iteration (`update`, `reflected`) and a whole run at once (`observe`, its
  merges planned 7 iterations at a time)."""
  monkeypatch.setattr(knowledge, "_CHUNK", 7)
  rng = np.random.default_rng(2)
  S = 3
  for N, depth in ((1, 2), (5, 2), (6, 3), (7, 5), (20, 2)):
    B = 30
    fast = knowledge.Knowledge(S, N, B + 1, depth, np.ones((S, B + 1), bool))
    know = np.zeros((S, N, N), np.int64)
    history = {0: know.copy()}
    run, read, floors, wants = [], np.zeros((S, B), int), [], []
    for p in range(B):
      for s in range(S):
        version = int(rng.integers(max(0, p + 2 - depth), p + 1))
        floor = rng.integers(0, 3, N) * int(rng.random() < 0.3)
        want = np.maximum(history[version][s], floor[:, None]).sum(axis=1)
        np.testing.assert_array_equal(fast.reflected(s, version, floor), want)
        read[s, p] = version
        floors.append(floor)
        wants.append(want)
      given, found = [], []
      for s in range(S):
        kind = rng.integers(4)
        if kind == 0:
          groups = ()
        elif kind == 1:
          groups = (np.arange(N),)
        else:
          order = rng.permutation(N)
          cuts = np.sort(rng.choice(np.arange(1, N), rng.integers(0, N) // 2,
                                    replace=False)) if N > 1 else []
          groups = tuple(np.split(order, cuts))
        if s == 1 and groups:
          sizes = [len(g) for g in groups]
          given.append(grouping.Groups(np.concatenate(groups),
                                       np.concatenate([[0], np.cumsum(sizes)])))
        elif s == 2 and kind > 1:
          pairs = rng.permutation(N)[:N // 2 * 2].reshape(-1, 2)
          given.append(pairs)
          groups = tuple(pairs)
        else:
          given.append(groups)
        found.append(groups)
      fast.update(p, given)
      run.append(given)
      know[:, np.arange(N), np.arange(N)] = p + 1
      for s in range(S):
        for g in found[s]:
          know[s, g] = know[s, g].max(axis=0)
      history[p + 1] = know.copy()
    whole = knowledge.Knowledge(S, N, B + 1, depth, np.ones((S, B + 1), bool))
    floor = np.array(floors).reshape(B, S, N).transpose(1, 0, 2)
    np.testing.assert_array_equal(
        whole.observe(run, read, floor),
        np.array(wants).reshape(B, S, N).transpose(1, 0, 2))
