"""SDPipe's grouping by arrival, across iterations (seed 002 Algorithms 1-2).

The scheduler (`grouping.ArrivalScheduler`) against Algorithm 2 written as a
plain event loop over (time, worker, iteration) signals
(`sdpipe_oracle.arrival_loop`), closed over random iteration times; the
simulator's walk by arrival (`stalepipe.sim.arrival`) against the same loop
fed the ready times it recorded, and its observed staleness against
explicit sets of updates.
"""

import numpy as np
import pytest

import sdpipe_oracle
import stalepipe as sp
from stalepipe.sim import cluster as cluster_lib
from stalepipe.sim import knowledge
from stalepipe.sim import reference
from stalepipe.sync import grouping


def drive(scheduler, num_stages, num_workers, num_iterations, next_signal,
          averaging):
  """Runs `scheduler` closed over `next_signal` as the simulator does: each
  group's members signal again after its averaging."""
  for s in range(num_stages):
    for w in range(num_workers):
      scheduler.signal(s, w, 0, next_signal(s, w, 0, 0.0))
  while (decision := scheduler.next()) is not None:
    s = decision[1]
    group = scheduler.decide(s)
    if group is None:
      continue
    resumed = group.close + averaging(s, len(group.members))
    for w, k in zip(group.members.tolist(), group.iterations.tolist()):
      if k + 1 < num_iterations:
        scheduler.signal(s, w, k + 1, next_signal(s, w, k + 1, resumed))
  return ([[(g.members.tolist(), g.iterations.tolist(), g.close)
            for g in stage] for stage in scheduler.groups],
          scheduler.skipped)


def random_case(rng):
  S, N, B = (int(rng.integers(1, 4)), int(rng.integers(1, 8)),
             int(rng.integers(2, 9)))
  grid = float(rng.choice([0.05, 1e-6]))  # coarse: ties everywhere
  seconds = np.round(rng.uniform(0.05, 1.0, (S, N, B)) / grid) * grid
  slow = rng.random((S, N, B)) < 0.2  # stragglers: iterations apart
  seconds[slow] += 1.5
  window = float(rng.choice([0.0, 0.1, float(rng.uniform(0, 0.5)), np.inf]))
  kwargs = dict(history=int(rng.integers(1, 6)),
                min_size=int(rng.choice([1, 1, 2, 3])),
                history_unit=str(rng.choice(["iteration", "group"])),
                enforce=bool(rng.random() < 0.8))
  per_size = float(rng.choice([0.0, 0.05]))
  averaging = lambda s, size: per_size * (size > 1)
  next_signal = lambda s, w, k, resumed: resumed + seconds[s, w, k]
  return S, N, B, window, kwargs, next_signal, averaging


def test_arrival_scheduler_decides_as_algorithm_2_on_random_clusters():
  """Random iteration times with stragglers, ties, T = 0 or inf, min_size
  up to 3, P counted either way: group for group, closes and skips."""
  rng = np.random.default_rng(0)
  mixed = skips = 0
  for trial in range(300):
    S, N, B, window, kw, next_signal, averaging = random_case(rng)
    got = drive(grouping.ArrivalScheduler(S, N, B, window=window, **kw),
                S, N, B, next_signal, averaging)
    want = sdpipe_oracle.arrival_loop(S, N, B, window=window,
                                      next_signal=next_signal,
                                      averaging=averaging, **kw)
    assert got == want, (trial, S, N, B, window, kw)
    mixed += sum(len(set(k)) > 1 for stage in got[0] for _, k, _ in stage)
    skips += len(got[1])
  assert mixed > 100 and skips > 10  # the cases the test is about occur


def cluster(N, S):  # two pipelines a node
  return sp.sim.Cluster.grid(N, S, devices_per_node=2 * S,
                             inter=sp.sim.Link(2e9, 1e-4))


def costs(S, param_bytes=2e6):
  return sp.sim.StageCosts.uniform(S, 0.01, 0.02, weight_gradient=0.01,
                                   param_bytes=param_bytes,
                                   activation_bytes=1e6, update=0.001)


def run(name, S, N, B, M=2, seed=0, param_bytes=2e6, **policy):
  short = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                            num_minibatches=3 * S + 8)
  return sp.sim.simulate(
      sp.sim.tile(short, B), cluster(N, S), costs(S, param_bytes),
      sp.sim.sdpipe(grouping="arrival", **policy),
      perturbations=[sp.sim.hete("B"), sp.sim.Stragglers(0.2, 0.03)],
      seed=seed)


CASES = [("1f1b", 3, 6, dict(history=3, window=0.01), {}),
         ("1f1b", 2, 5, dict(history=1, window=0.004), {}),
         ("gpipe", 2, 4, dict(history=4, window=0.0, min_size=2), {}),
         ("pipedream", 3, 4, dict(history=2, window=0.01,
                                  history_unit="group"), {}),
         ("zb-h1", 2, 5, dict(history=5, window=np.inf), {}),
         ("1f1b", 1, 7, dict(history=2, window=0.02, min_size=3), {}),
         # A drain whose update ends after the group before was sent but
         # before its averaging ended: the signal waits for the averaging.
         ("pipedream", 4, 5, dict(history=3, window=0.01),
          dict(seed=1, param_bytes=3e9))]


@pytest.mark.parametrize("name,S,N,policy,setup", CASES)
def test_simulated_groups_are_algorithm_2_on_the_recorded_signals(
    name, S, N, policy, setup):
  """The walk's groups, closes and skips are the event loop's fed the ready
  times the run recorded (each update's end, by the engine's rules); every
  member's next version is in place when its group's averaging ends."""
  B = 24
  r = run(name, S, N, B, **policy, **setup)
  # [S, B, N]: each update's end (replayed from the recorded versions), or
  # the version before it in place, if later (Algorithm 1: step B of one
  # iteration before the next's, as an asynchronous schedule drains)
  ready = np.maximum(r.applied_local, r.applied[:, :-1])
  groups = r.extras["sdpipe_arrivals"]
  want_groups, want_skipped = sdpipe_oracle.arrival_loop(
      S, N, B, next_signal=lambda s, w, k, _: ready[s, k, w], **policy)
  assert [[(g.members.tolist(), g.iterations.tolist(), g.close) for g in st]
          for st in groups] == want_groups
  assert r.extras["sdpipe_skipped"] == want_skipped
  ends = {}
  for s, event in r.comm:
    assert (event.start == event.start[0]).all()
    ends[s, event.start[0], tuple(event.pipelines.tolist())] = event.end[0]
  for s, stage in enumerate(groups):
    assert sum(len(g.members) for g in stage) == N * B
    for g in stage:
      np.testing.assert_array_equal(g.ready, ready[s, g.iterations, g.members])
      size = len(g.members)
      end = g.close + cluster_lib.ring_allreduce_seconds(
          r.costs.param_bytes[s], size, r.cluster.group_link(s, g.members))
      if size > 1:
        assert ends[s, g.close, tuple(g.members.tolist())] == end
      np.testing.assert_array_equal(
          r.applied[s, g.iterations + 1, g.members],
          np.maximum(end, r.applied[s, g.iterations, g.members]))


def test_stragglers_mix_iterations_in_a_group():
  """Under hete-B a fast worker's signal after iteration k + 1 meets a slow
  one's after k; grouping by iteration never mixes them."""
  S, N, B = 2, 8, 60
  r = run("1f1b", S, N, B, history=10, window=0.01)
  groups = [g for stage in r.extras["sdpipe_arrivals"] for g in stage]
  mixed = [len(set(g.iterations.tolist())) > 1 for g in groups]
  assert np.mean(mixed) > 0.1
  spread = max(int(np.ptp(g.iterations)) for g in groups)
  assert spread >= 1


def reflected_by_sets(groups, read, N):
  """`knowledge.by_arrival` as explicit sets of (worker, iteration) updates
  that each worker's weights hold."""
  S, B = read.shape
  out = np.zeros((S, B, N), np.int64)
  for s in range(S):
    holds = [set() for _ in range(N)]
    count = {}  # (worker, version) -> updates its weights of that version hold
    for g in groups[s]:
      members = g.members.tolist()
      union = set().union(*(holds[m] | {(m, k)} for m, k in
                            zip(members, g.iterations.tolist())))
      for m, k in zip(members, g.iterations.tolist()):
        holds[m] = set(union)
        count[m, k + 1] = len(union)
    for p in range(B):
      for i in range(N):
        out[s, p, i] = count.get((i, read[s, p]), 0)
  return out


@pytest.mark.parametrize("name,S,N,policy,setup", CASES[:4])
def test_observed_staleness_counts_the_members_updates_up_to_their_iterations(
    name, S, N, policy, setup):
  """A worker after a group reflects every member's updates up to that
  member's iteration (explicit sets); staleness is the updates in place
  anywhere before its own minus those."""
  B = 24
  r = run(name, S, N, B, **policy, **setup)
  schedule = r.schedule
  read = np.full((S, B), B)  # the version each backward read
  for t in schedule.tasks:
    if schedule.kind(t).runs_backward:
      read[t.stage, t.minibatch] = min(read[t.stage, t.minibatch],
                                       schedule.task_version(t))
  want = reflected_by_sets(r.extras["sdpipe_arrivals"], read, N)
  np.testing.assert_array_equal(
      knowledge.by_arrival(r.extras["sdpipe_arrivals"], read, N), want)
  applied = r.applied[:, 1:]  # [S, B, N]
  fresher = np.array([[[(applied[s] < applied[s, p, i]).sum()
                        for p in range(B)] for i in range(N)]
                      for s in range(S)])  # [S, N, B]
  np.testing.assert_array_equal(r.staleness,
                                (fresher - want.transpose(0, 2, 1)).transpose(
                                    1, 2, 0))
  assert (r.staleness >= 0).all()


def test_grouping_by_arrival_is_refused_where_it_cannot_run():
  one_line = ("grouping='arrival' forms groups across iterations, which the "
              "lockstep executor cannot run; valid: grouping='iteration' (the "
              "executor and the simulator) or 'arrival' (the simulator only)")
  policy = sp.sync.sdpipe(4, grouping="arrival")
  for call in (lambda: policy.mixing(0, 0), lambda: policy.plan(0, 2, 2)):
    with pytest.raises(ValueError) as e:
      call()
    assert str(e.value) == one_line
  s = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
                        num_minibatches=4)
  with pytest.raises(ValueError) as e:
    sp.sync.make("simulated", num_replicas=4, policy="sdpipe",
                 policy_kwargs={"grouping": "arrival"}, schedule=s,
                 num_steps=8)
  assert str(e.value) == f"policy_kwargs of 'sdpipe': {one_line}"
  with pytest.raises(ValueError, match="grouping='arrivals' is invalid; "
                     "valid: iteration, arrival$"):
    sp.sync.sdpipe(4, grouping="arrivals")
  with pytest.raises(ValueError, match="grouping=None is invalid"):
    sp.sim.sdpipe(10, 0.01, grouping=None)
  with pytest.raises(ValueError, match="^sync policy 'sdpipe' groups workers "
                     "across iterations, .*; valid: stalepipe.sim.simulate$"):
    reference.simulate(s, cluster(4, 2), costs(2), policy)
  # One object for both sides: the simulator times it.
  r = sp.sim.simulate(s, cluster(4, 2), costs(2), policy)
  assert "sdpipe_arrivals" in r.extras


def test_an_update_that_takes_no_time_is_refused():
  s = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1,
                        num_minibatches=3)
  free = sp.sim.StageCosts.uniform(1, 0.0, 0.0)
  with pytest.raises(ValueError, match="needs every update's last task and "
                     "step to take time; valid: positive stage costs"):
    sp.sim.simulate(s, cluster(2, 1), free, sp.sim.sdpipe(
        2, 0.1, grouping="arrival"))
