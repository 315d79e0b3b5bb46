r"""Discrete-event simulation of a schedule plus a sync policy on a cluster.

Every pipeline replays the schedule's per-stage task order (the order of
`schedule.tasks` on each stage) with durations from the cost model. A task
starts when all of these hold:

- its device is free: after the previous task of the stage (of the
  device, for a device-level schedule: its chunks' tasks in schedule order);
  before the first task of an iteration, also after the worker's own sync of
  its last update (Algorithm 1 of seed 002: step B ends an iteration) and a
  straggler's sleep;
- its input has arrived: F(p, m) on `s` after F(p, m) on `s-1` plus the
  activation transfer, B(p, m) on `s` after B/FB(p, m) on `s+1` plus the
  gradient transfer, a last-stage B after its own F; no transfer between
  two chunks of one device;
- the version it reads is in place: stage `s` has applied that many updates
  (the update of minibatch `p` follows the last backward of `p` on `s`, in
  minibatch order, and then the sync policy's exchange);
- the sync policy's gate, if any (WSP's clock distance).

.. math::

  \text{start} = \max(\text{free} + \text{sleep},\ \text{input} +
  \text{transfer},\ \text{applied}_{s,v},\ \text{gate}),\quad
  \text{end} = \text{start}
  + \frac{c_{kind,s} \cdot \text{slowdown}}{\text{speed}}

The two tasks of an overlapped pair (DualPipe's F&B) start together, when
both are ready, and free the device when the later ends: a pair of a
forward and a backward takes :math:`\max(c_F, c_B)`.

Since every pipeline runs the same per-stage order, each task is a few NumPy
operations over all pipelines, written in place; events are processed in the
schedule's task order, which is a topological order of these dependencies.
The schedule is compiled to index arrays with NumPy, link costs are a few
distinct rows rather than one per task, and observed staleness is tracked in
`O(N)` per update unless groups leave replicas out (`knowledge`). Pipelines
only meet at syncs, where the policy sees all ready times at once. A policy
that decides several syncs at once (`Runner.defers`: SDPipe) has each sync
held until a task reads the version it applies, and is then handed the held
syncs of one minibatch together (`Runner.sync_many`). Observed staleness,
which never feeds back into time, is merged after the walk
(`Knowledge.observe`). A policy whose groups hold workers at different
iterations (`Runner.crosses_iterations`: SDPipe's grouping by arrival) is
walked worker by worker in time order instead (`stalepipe.sim.arrival`),
then once more as above with the versions' recorded times, for the waits.

The walk keeps only a ring of the task rows a later task looks back on (its
dependency, the stage's previous task, the iteration's first task): busy
seconds are the iterations' reference seconds times their slowdowns, waits
are summed as they happen, and the last task of a stage ends its latest. The
per-task times (`[tasks, N]`, 2 GB for 1,024 workers x 10,000 minibatches of
a 4-stage 1F1B) are computed when first read (`SimResult.start`, ...), by
walking the run again with the syncs' recorded outcomes (`applied`, gates):
the same operations on the same numbers. The result equals
`stalepipe.sim.reference`'s, event for event (tests check it).

References:
  Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §4-§5;
  Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023, §3, §5
"""

import dataclasses
import functools
import operator
from typing import NamedTuple, Sequence

import numpy as np

from stalepipe.schedules import core
from stalepipe.schedules import kinds
from stalepipe.sim import arrival as arrival_lib
from stalepipe.sim import cluster as cluster_lib
from stalepipe.sim import knowledge as knowledge_lib
from stalepipe.sim import policy as policy_lib
from stalepipe.sim import stragglers as stragglers_lib
from stalepipe.sim import result as result_lib

class Program(NamedTuple):
  """A schedule compiled to index arrays, tasks in schedule order."""

  stage: np.ndarray  # [T] int
  minibatch: np.ndarray  # [T] int
  dep: np.ndarray  # [T] int, the task whose output this one needs; -1 none
  boundary: np.ndarray  # [T] int, link crossed: stage b -> b+1; -1 none
  volume: np.ndarray  # [T] float, micro-batches of activation moved
  version: np.ndarray  # [T] int
  first: np.ndarray  # [T] bool, first task of (minibatch, stage)
  own: np.ndarray  # [T] int, updates the stage triggered before the task
  trigger: np.ndarray  # [T] bool, last backward of (minibatch, stage)
  base: np.ndarray  # [T] float, seconds on the reference device
  cost_class: np.ndarray  # [T] int, kind * S + stage: tasks of equal base
  backward_version: np.ndarray  # [S, B] oldest version a backward reads
  first_task: np.ndarray  # [S, B] index of the first task
  device: np.ndarray  # [T] int, the device that runs the task (its stage's)
  lead: np.ndarray  # [T] int, for the later task of an overlapped pair the
  #   earlier one; -1 otherwise


def compile_schedule(schedule: core.Schedule,
                     costs: cluster_lib.StageCosts) -> Program:
  """The schedule's dependencies, versions and costs as `[tasks]` arrays.

  A device-level schedule's stages sit on its devices (`device_of`); an
  input made on the same device crosses no link.

  Raises:
    ValueError: a task runs before the task whose output it needs, a stage
      finishes its minibatches' backwards out of order, a task reads a
      version before it is applied, or an overlapped pair closes an update.
  """
  S, B, M = (schedule.num_stages, schedule.num_minibatches,
             schedule.num_microbatches)
  tasks = schedule.tasks
  T = len(tasks)
  names = tuple(kinds.KINDS)
  code = {name: k for k, name in enumerate(names)}
  stage, kind_names, minibatch, micro = (
      list(map(operator.itemgetter(k), tasks)) for k in range(1, 5))
  versions = schedule.versions
  version = np.fromiter(
      map(versions.__getitem__, zip(minibatch, stage, kind_names, micro)),
      np.int64, T)
  stage, minibatch = np.asarray(stage), np.asarray(minibatch)
  micro = np.asarray(micro)
  kind = np.fromiter(map(code.__getitem__, kind_names), np.int64, T)
  table = [kinds.KINDS[name] for name in names]
  has = lambda prop: np.array([prop(k) for k in table])[kind]
  forward = has(lambda k: k.runs_forward)
  sends_back = has(lambda k: kinds.INPUT_COTANGENT in k.produces)
  takes_back = has(lambda k: kinds.OUTPUT_COTANGENT in k.consumes)
  closes = has(lambda k: k.closes_update)
  backward = has(lambda k: k.runs_backward)
  covers = schedule.backward_covers_minibatch & ~forward
  covered = np.where(covers, M, 1)
  last_micro = np.where(covers, M - 1, micro)
  seconds = np.array([[costs.seconds(k, s) for s in range(S)] for k in table])
  base = seconds[kind, stage] * covered

  index = np.arange(T)
  fwd = np.full((B, M, S), -1)
  fwd[minibatch[forward], micro[forward], stage[forward]] = index[forward]
  bwd = np.full((B, M, S), -1)
  bwd[minibatch[sends_back], micro[sends_back], stage[sends_back]] = (
      index[sends_back])
  receives = forward & (stage > 0)
  returns = ~receives & takes_back & (stage < S - 1)
  own_forward = ~receives & ~returns & ~forward
  dep = np.full(T, -1)
  dep[receives] = fwd[minibatch[receives], micro[receives],
                      stage[receives] - 1]
  dep[returns] = bwd[minibatch[returns], micro[returns], stage[returns] + 1]
  dep[own_forward] = fwd[minibatch[own_forward], last_micro[own_forward],
                         stage[own_forward]]
  needs = receives | returns | own_forward
  bad = np.flatnonzero(needs & ((dep < 0) | (dep >= index)))
  if bad.size:
    raise ValueError(f"{tasks[bad[0]]} of schedule {schedule.name!r} runs "
                     "before the task whose output it needs")
  boundary = np.full(T, -1)
  boundary[receives] = stage[receives] - 1
  boundary[returns] = stage[returns]
  on_device = device_of(schedule)
  crosses = boundary >= 0
  boundary[crosses & (on_device[boundary] == on_device[boundary + 1])] = -1
  volume = np.zeros(T)
  volume[receives] = 1
  volume[returns] = covered[returns]

  key = stage * B + minibatch
  first_task = np.full(S * B, -1)
  keys, firsts = np.unique(key, return_index=True)
  first_task[keys] = firsts
  first = np.zeros(T, bool)
  first[firsts] = True
  last_backward = np.full(S * B, -1)
  closing = np.flatnonzero(closes)
  np.maximum.at(last_backward, key[closing], closing)
  last_backward = last_backward.reshape(S, B)
  trigger = np.zeros(T, bool)
  trigger[last_backward[last_backward >= 0]] = True
  check_update_order(last_backward, schedule.name)
  backward_version = np.full(S * B, np.iinfo(np.int64).max)
  np.minimum.at(backward_version, key[backward], version[backward])
  own = np.zeros(T, np.int64)
  for s in range(S):
    mine = stage == s
    own[mine] = np.cumsum(trigger[mine]) - trigger[mine]
  reads = np.flatnonzero(version > 0)
  early = reads[last_backward[stage[reads], version[reads] - 1] >= reads]
  if early.size:
    t = tasks[early[0]]
    raise ValueError(f"{t} reads version {version[early[0]]} before stage "
                     f"{t.stage} applies the update of minibatch "
                     f"{version[early[0]] - 1}")
  return Program(stage=stage, minibatch=minibatch, dep=dep, boundary=boundary,
                 volume=volume, version=version, first=first, own=own,
                 trigger=trigger, base=base, cost_class=kind * S + stage,
                 backward_version=backward_version.reshape(S, B),
                 first_task=first_task.reshape(S, B),
                 device=on_device[stage], lead=pairs(schedule, trigger))


def device_of(schedule: core.Schedule) -> np.ndarray:
  """`[S]` the device of each stage: its own for a stage-level schedule,
  `placed.stages[d, j] = s` for a device-level one."""
  if schedule.placed is None:
    return np.arange(schedule.num_stages)
  stages = schedule.placed.stages
  out = np.empty(stages.size, np.int64)
  out[stages] = np.arange(len(stages))[:, None]
  return out


def pairs(schedule: core.Schedule, trigger: np.ndarray) -> np.ndarray:
  """`[T]` for the later (in schedule order) task of each overlapped F&B
  pair, the index of the earlier; -1 elsewhere.

  Raises:
    ValueError: a pair's task closes an update (the walk moves the earlier
      task's start once the later is ready, after its update would be timed).
  """
  lead = np.full(len(trigger), -1)
  if not schedule.overlapped:
    return lead
  index = {t: i for i, t in enumerate(schedule.tasks)}
  for pair in schedule.overlapped:
    i, j = sorted(index[t] for t in pair)
    if trigger[i] or trigger[j]:
      raise ValueError(f"overlapped pair {pair} of schedule {schedule.name!r} "
                       "closes an update; valid: pairs of tasks that close none")
    lead[j] = i
  return lead


def check_update_order(last_backward: np.ndarray, name: str) -> None:
  """Refuses a schedule whose stage `s` closes minibatch updates out of order
  (`last_backward[s, p]`: the task after which stage `s` updates `p`)."""
  for s, order in enumerate(last_backward):
    if (order < 0).any() or (np.diff(order) <= 0).any():
      raise ValueError(f"stage {s} of schedule {name!r} must finish the "
                       "backwards of its minibatches in minibatch order")


def simulate(schedule: core.Schedule, cluster: cluster_lib.Cluster,
             costs: cluster_lib.StageCosts,
             policy=None, *,
             perturbations: Sequence = (), seed: int = 0
             ) -> result_lib.SimResult:
  """Times `schedule` on every pipeline of `cluster` under a sync policy.

  Args:
    schedule: the per-pipeline schedule (`stalepipe.schedules.make`), built
      for the number of minibatches to simulate.
    cluster: `[pipelines][stages]` devices and links.
    costs: per-stage costs on the reference device.
    policy: a sync policy: one of `stalepipe.sync` over the cluster's
      pipelines (`sp.sync.wsp(N, clock_distance=D, concurrent_minibatches=
      N_m)`, ...: the same object the executors run), or a time-only one
      (`bsp()`, `wsp(D, N_m)`, `sdpipe(P, T)`, `parameter_server()`, ...);
      default `isolated()`.
    perturbations: `Stragglers` and `Trace`s; delays add, multipliers
      multiply.
    seed: seeds the Generator behind stragglers and random policies.

  Returns:
    A `SimResult`.

  Examples:
    >>> import stalepipe as sp
    >>> s = sp.schedules.make("gpipe", num_stages=2, num_microbatches=3)
    >>> r = simulate(s, sp.sim.Cluster.grid(1, 2), sp.sim.StageCosts.uniform(2))
    >>> round(r.makespan, 3), s.num_ticks
    (8.0, 8)
  """
  policy, runner, delay, scale, update, chunks = start_run(
      schedule, cluster, costs, policy, perturbations, seed)
  S, B, N = schedule.num_stages, schedule.num_minibatches, cluster.num_pipelines
  plan = compile_schedule(schedule, costs)
  links, link_of = _transfers(plan, chunks, costs)
  walk = _Walk.of(plan, links, link_of, gates=runner.gates)
  applied = np.full((S, B + 1, N), np.inf)
  applied[:, 0] = 0.0
  local_end = np.zeros((S, B, N))
  gate = np.full((S, B), -np.inf)
  depth = int((np.arange(1, B + 1)[None] - plan.backward_version).max()) + 1
  kept = np.zeros((S, B + 1), bool)  # versions a backward reads after a
  for s in range(S):  # newer one is in
    kept[s, plan.backward_version[s][plan.backward_version[s] < np.arange(B)]
         ] = True
  syncs = _Syncs(runner, reflected=np.zeros((S, B, N), dtype=np.int64),
                 comm=[], groups=[{} for _ in range(B)])
  rows = _rows(walk.window, N)
  if runner.crosses_iterations:
    # Each worker on its own, in time order; then the walk again with the
    # versions' recorded times, for the waits.
    comm, groups = arrival_lib.walk_by_arrival(walk, runner, delay, scale,
                                               update, applied, local_end)
    syncs.comm.extend(comm)
    wait, last_end = _walk(walk, rows, delay, scale, update, applied,
                           local_end, gate, None)
    syncs.reflected[:] = knowledge_lib.by_arrival(
        groups, plan.backward_version, N)
  else:
    wait, last_end = _walk(walk, rows, delay, scale, update, applied,
                           local_end, gate, syncs)
    # Observed staleness never feeds back into time: after the walk,
    # minibatch by minibatch, what each backward read, then the groups
    # merged.
    knowledge_lib.Knowledge(S, N, B + 1, depth, kept).observe(
        [[synced[s] for s in range(S)] for synced in syncs.groups],
        plan.backward_version, syncs.reflected)
  busy = np.einsum("bsn,bs->sn", scale, walk.iteration_seconds)
  task_times = functools.partial(_replay, walk, delay, scale, update, applied,
                                 local_end, gate)
  return finish_run(schedule, cluster, costs, policy, runner,
                    task_times=task_times, end_max=last_end, applied=applied,
                    local_end=local_end, reflected=syncs.reflected, busy=busy,
                    wait=wait, delay=delay, update=update, comm=syncs.comm,
                    overlap=_overlap(plan, scale, walk.num_devices))


def _overlap(plan: Program, scale: np.ndarray, P: int) -> np.ndarray:
  r"""`[P, N]` seconds the overlapped pairs' tasks ran together on each
  device: :math:`\min(c_F, c_B)` per pair, which the device's busy time
  counts once (the pair takes :math:`\max(c_F, c_B)`)."""
  later = np.flatnonzero(plan.lead >= 0)
  earlier = plan.lead[later]
  seconds = [plan.base[i, None] * scale[plan.minibatch[i], plan.stage[i]]
             for i in (earlier, later)]
  out = np.zeros((P, scale.shape[2]))
  np.add.at(out, plan.device[later], np.minimum(*seconds))
  return out


class _Walk(NamedTuple):
  """The program as Python lists for the task loop, plus what it derives.

  A task's input is in when the device is free if its dependency ran on its
  own device; so is a version no newer than one an earlier task of the stage
  read (`_reads_new_version`): `link` is -1 and `checks` False there, and
  the loop skips those maxima. Both tasks of an overlapped pair check, so
  that each keeps its own ready time.
  """

  plan: Program
  links: np.ndarray  # [L, N] seconds on a link; row `link[i]` for task i
  stage: list  # [T] int
  minibatch: list  # [T] int
  dep: list  # [T] int, the dependency's row in a ring of `window` rows
  device: list  # [T] int
  pair: list  # [T] int: 0 alone, 1 the earlier, 2 the later task of a pair
  lead: list  # [T] int, the earlier task of the later one's pair
  link: list  # [T] int, -1 without a link
  version: list  # [T] int
  first: list  # [T] bool
  own: list  # [T] int
  trigger: list  # [T] bool
  base: list  # [T] float
  checks: list  # [T] bool: may wait for a version (or a gate)
  waits: np.ndarray  # [T] bool, `checks` as an array
  first_row: np.ndarray  # [S, B] the ring row of each iteration's first task
  window: int  # rows a task may look back: dependency, device, iteration,
  #   pair
  iteration_seconds: np.ndarray  # [B, S] reference seconds of an iteration
  gates: bool
  num_devices: int

  @classmethod
  def of(cls, plan: Program, links: np.ndarray, link_of: np.ndarray,
         gates: bool) -> "_Walk":
    T = len(plan.stage)
    index = np.arange(T)
    back = [np.where(plan.dep >= 0, index - plan.dep, 0)]
    trigger_at = np.flatnonzero(plan.trigger)
    S, B = plan.first_task.shape
    key = plan.stage[trigger_at] * B + plan.minibatch[trigger_at]
    back.append(trigger_at - plan.first_task.ravel()[key])
    P = int(plan.device.max(initial=0)) + 1
    for d in range(P):
      back.append(np.diff(np.flatnonzero(plan.device == d)))
    later = plan.lead >= 0
    back.append(index[later] - plan.lead[later])
    window = int(max(b.max(initial=0) for b in back)) + 1
    pair = np.zeros(T, np.int64)
    pair[plan.lead[later]], pair[later] = 1, 2
    waits = _reads_new_version(plan) | (plan.first & gates) | (pair > 0)
    seconds = np.zeros(S * B)
    np.add.at(seconds, plan.stage * B + plan.minibatch, plan.base)
    return cls(plan=plan, links=links, stage=plan.stage.tolist(),
               minibatch=plan.minibatch.tolist(),
               dep=(plan.dep % window).tolist(),
               device=plan.device.tolist(), pair=pair.tolist(),
               lead=plan.lead.tolist(), link=link_of.tolist(),
               version=plan.version.tolist(), first=plan.first.tolist(),
               own=plan.own.tolist(), trigger=plan.trigger.tolist(),
               base=plan.base.tolist(), checks=waits.tolist(), waits=waits,
               first_row=plan.first_task % window, window=window,
               iteration_seconds=seconds.reshape(S, B).T, gates=gates,
               num_devices=P)


class _Rows(NamedTuple):
  """Per-task rows `[R, N]`: the whole run (R = T), or a ring of the last R."""

  start: np.ndarray
  end: np.ndarray
  ready: np.ndarray
  blocked: np.ndarray
  sleep_at: np.ndarray


def _rows(num_rows: int, N: int) -> _Rows:
  return _Rows(*(np.zeros((num_rows, N)) for _ in range(5)))


class _Syncs(NamedTuple):
  """What the first walk does at each update: the policy's sync and the
  exchanges (absent when replaying recorded syncs), and each sync's groups
  for observed staleness."""

  runner: policy_lib.Runner
  reflected: np.ndarray  # [S, B, N] int: the policy's floor until observed
  comm: list  # (stage, CommEvent)
  groups: list  # [B] {stage: groups} of each minibatch's syncs


def _walk(walk: _Walk, rows: _Rows, delay, scale, update, applied, local_end,
          gate, syncs: _Syncs | None) -> tuple[np.ndarray, np.ndarray]:
  """Runs every task once, in schedule order, over all pipelines at once.

  With `syncs`, rows are a ring of `walk.window` (a task looks back no
  further), the policy fills `applied` and `gate` as updates close; without,
  they are the whole run's and `applied`, `gate` are a first walk's.

  Returns:
    `(wait [S, N], last_end [N])`: seconds waiting for a sync, version or
    gate, and each pipeline's last task end.
  """
  S, N = len(applied), rows.start.shape[1]
  R = len(rows.start)
  wait, scratch = np.zeros((S, N)), np.empty(N)
  free = [np.zeros(N) for _ in range(walk.num_devices)]
  stage, minibatch, dep, link = walk.stage, walk.minibatch, walk.dep, walk.link
  device, pair = walk.device, walk.pair
  version, first, trigger, own = (walk.version, walk.first, walk.trigger,
                                  walk.own)
  base, checks, links = walk.base, walk.checks, walk.links
  gates = walk.gates
  # Rows read every task as lists of views: a list index costs less than
  # making the view (the ring's rows; the whole run's stay arrays).
  start, end, ready, blocked, sleep_at = (
      rows if syncs is None else [list(a) for a in rows])
  links, scale = list(links), [list(x) for x in scale]
  maximum, add, subtract, multiply = (np.maximum, np.add, np.subtract,
                                      np.multiply)
  defers = syncs is not None and syncs.runner.defers
  if defers and (syncs.runner.gates or syncs.runner.floors):
    raise ValueError("a runner that defers its syncs may neither gate nor "
                     "floor; valid: defers=False")
  held = {}  # stage -> its minibatch whose sync is held back (`defers`)
  for i in range(len(stage)):
    s, p, k, d = stage[i], minibatch[i], i % R, device[i]
    f = free[d]
    if held and s in held and (first[i] or version[i] > held[s]):
      _sync_held(syncs, walk, held, applied, local_end)
    if first[i]:
      synced = maximum(f, applied[s, own[i]], out=sleep_at[k])
      subtract(synced, f, out=blocked[k])
      add(wait[s], blocked[k], out=wait[s])
      f = synced + delay[p, s]
    st = start[k]
    if link[i] >= 0:
      add(end[dep[i]], links[link[i]], out=st)
      maximum(f, st, out=st)
    else:
      st[:] = f
    if checks[i]:
      r = ready[k]
      r[:] = st
      maximum(st, applied[s, version[i]], out=st)
      if gates and first[i]:
        if syncs is not None:
          gate[s, p] = syncs.runner.gate(s, p)
        maximum(st, gate[s, p], out=st)
      add(wait[s], subtract(st, r, out=scratch), out=wait[s])
    if pair[i] == 2:
      _start_together(walk, walk.lead[i], st, start, end, scale)
    e = multiply(scale[p][s], base[i], out=end[k])
    add(st, e, out=e)
    if pair[i]:  # the device is free when the pair's later task ends
      e = f if pair[i] == 1 else maximum(e, end[walk.lead[i] % R])
    if not trigger[i]:
      free[d] = e
      continue
    e = free[d] = add(e, update[p, s], out=local_end[s, p])
    if defers:
      if s in held:  # one held sync per stage, so that they stay in order
        _sync_held(syncs, walk, held, applied, local_end)
      held[s] = p
    elif syncs is not None:
      _synced(syncs, walk, s, p, syncs.runner.sync(s, p, e), applied, start)
  if held:
    _sync_held(syncs, walk, held, applied, local_end)
  last = np.max([end[(np.flatnonzero(walk.plan.stage == s)[-1]) % R]
                 for s in range(S)], axis=0)
  return wait, last


def _start_together(walk: _Walk, lead: int, st: np.ndarray, start, end,
                    scale) -> None:
  """An overlapped pair (DualPipe's F&B) starts when both are ready: the
  later task's start `st` and the earlier's, `lead`, become their maximum,
  and the earlier ends its own cost after it."""
  k = lead % len(start)
  np.maximum(st, start[k], out=st)
  start[k][:] = st
  e = np.multiply(scale[walk.minibatch[lead]][walk.stage[lead]],
                  walk.base[lead], out=end[k])
  np.add(st, e, out=e)


def _synced(syncs: _Syncs, walk: _Walk, stage: int, minibatch: int,
            out: policy_lib.SyncOutcome, applied, start) -> None:
  """Records what the sync of `stage` after `minibatch` did."""
  s, p = stage, minibatch
  np.maximum(out.applied, applied[s, p], out=applied[s, p + 1])
  if syncs.runner.floors:
    syncs.reflected[s, p] = syncs.runner.floor(s, start[walk.first_row[s, p]])
  syncs.groups[p][s] = out.groups
  syncs.comm.extend((s, c) for c in out.comm)


def _sync_held(syncs: _Syncs, walk: _Walk, held: dict, applied, local_end
               ) -> None:
  """The syncs held back, in the order their updates closed: those of one
  minibatch decided together (`Runner.sync_many`)."""
  order = list(held.items())
  held.clear()
  while order:
    p = order[0][1]
    run = next((k for k, (_, q) in enumerate(order) if q != p), len(order))
    stages = [s for s, _ in order[:run]]
    for s, out in zip(stages, syncs.runner.sync_many(stages, p,
                                                     local_end[stages, p])):
      _synced(syncs, walk, s, p, out, applied, None)
    order = order[run:]


def _replay(walk: _Walk, delay, scale, update, applied, local_end, gate
            ) -> result_lib.TaskTimes:
  """Every task's times, walking the run again with its recorded syncs."""
  plan = walk.plan
  T, N = len(plan.stage), applied.shape[2]
  rows = _rows(T, N)
  _walk(walk._replace(dep=plan.dep.tolist()), rows, delay, scale, update,
        applied, local_end, gate, None)
  np.copyto(rows.ready, rows.start, where=~walk.waits[:, None])
  sleep = np.zeros((T, N))
  firsts = np.flatnonzero(plan.first)
  sleep[firsts] = delay[plan.minibatch[firsts], plan.stage[firsts]]
  return result_lib.TaskTimes(rows.start, rows.end, rows.ready, rows.blocked,
                              rows.sleep_at, sleep)


def start_run(schedule: core.Schedule, cluster: cluster_lib.Cluster,
              costs: cluster_lib.StageCosts, policy, perturbations: Sequence,
              seed: int) -> tuple:
  """Checks sizes, draws the slowdowns and starts the policy's runner.

  Slowdowns are drawn per device (`[B, N, P]`); a device-level schedule's
  chunks take their device's factor, and its sleep is taken before the
  device's first task of the minibatch. Grouping by arrival
  (`Runner.crosses_iterations`) is refused for a device-level schedule.

  Returns:
    `(policy, runner, delay, scale, update, chunks)`: the middle three
    `[B, S, N]`, the sleep before each iteration, the factor on each
    reference second (slowdown over speed) and the optimizer step's seconds;
    `chunks` the cluster one column per stage (`by_stage`), which the policy
    sees.
  """
  B, N = schedule.num_minibatches, cluster.num_pipelines
  chunks = by_stage(schedule, cluster, costs)
  policy = policy_lib.time_side(policy or policy_lib.isolated(), N)
  straggler_rng, policy_rng = np.random.default_rng(seed).spawn(2)
  delay, multiplier = stragglers_lib.slowdowns(
      perturbations, (B, N, cluster.num_stages), straggler_rng)
  if schedule.placement is not None:
    on_device = device_of(schedule)
    delay = delay[..., on_device] * _opens(schedule, on_device)[:, None]
    multiplier = multiplier[..., on_device]
  speed = chunks.speed  # [N, S]
  scale = np.divide(multiplier.transpose(0, 2, 1), speed.T[None],
                    out=np.empty((B, schedule.num_stages, N)))
  delay = np.ascontiguousarray(delay.transpose(0, 2, 1))  # [B, S, N]
  update = np.asarray(costs.update)[None, :, None] * scale  # [B, S, N]
  runner = policy.start(policy_lib.Context(chunks, costs, B, policy_rng))
  if runner.crosses_iterations and schedule.placement is not None:
    raise ValueError(f"sync policy {policy.name!r} groups workers across "
                     "iterations, which is not timed for device-level "
                     f"schedule {schedule.name!r}; valid: a stage-level one")
  return policy, runner, delay, scale, update, chunks


def by_stage(schedule: core.Schedule, cluster: cluster_lib.Cluster,
             costs: cluster_lib.StageCosts) -> cluster_lib.Cluster:
  """The cluster as one column per stage: itself for a stage-level schedule
  (`[N][S]` devices); for a device-level one (`[N][P]`), stage `s` on its
  device's column, `devices[i][d(s)]` (so its links and syncs are its
  device's).

  Raises:
    ValueError: in one line, where costs have a row count other than S or
      the cluster neither S (stage-level) nor P (device-level) devices a
      pipeline.
  """
  S, P, name = schedule.num_stages, schedule.num_devices, schedule.name
  if costs.num_stages != S:
    raise ValueError(f"costs has {costs.num_stages} stages; valid: one per "
                     f"stage of schedule {name!r}, {S}")
  if schedule.placement is None and cluster.num_stages != S:
    raise ValueError(f"cluster has {cluster.num_stages} stages (devices a "
                     f"pipeline); valid: {S}, those of schedule {name!r}")
  if schedule.placement is None:
    return cluster
  if cluster.num_stages != P:
    raise ValueError(f"cluster has {cluster.num_stages} stages (devices a "
                     f"pipeline); valid: {P}, the devices of device-level "
                     f"schedule {name!r} ({S} stages, {schedule.placement} "
                     "placement)")
  on_device = device_of(schedule).tolist()
  return dataclasses.replace(cluster, devices=tuple(
      tuple(row[d] for d in on_device) for row in cluster.devices))


def _opens(schedule: core.Schedule, on_device: np.ndarray) -> np.ndarray:
  """`[B, S]` whether stage `s` runs its device's first task of minibatch
  `p`."""
  tasks = schedule.tasks
  stage = np.fromiter((t.stage for t in tasks), np.int64, len(tasks))
  minibatch = np.fromiter((t.minibatch for t in tasks), np.int64, len(tasks))
  _, first = np.unique(minibatch * len(on_device) + on_device[stage],
                       return_index=True)
  out = np.zeros((schedule.num_minibatches, schedule.num_stages), bool)
  out[minibatch[first], stage[first]] = True
  return out


def finish_run(schedule, cluster, costs, policy, runner, *, task_times,
               end_max, applied, local_end, reflected, busy, wait, delay,
               update, comm, overlap) -> result_lib.SimResult:
  """The `SimResult` of a finished walk.

  Args:
    task_times: a `TaskTimes`, or a function that computes it.
    end_max: `[N]` (or any shape) the latest task end.
    busy, wait: `[S, N]` seconds of tasks, and of waits before them.
    overlap: `[P, N]` seconds overlapped pairs ran together on each device.
  """
  B = schedule.num_minibatches
  makespan = float(max(applied[:, B].max(), np.max(end_max)))
  busy = busy + update.sum(0)
  delayed = delay.sum(0)
  return result_lib.SimResult(
      schedule=schedule, cluster=cluster, policy=policy.name,
      makespan=makespan, busy=busy.T, wait=wait.T, delayed=delayed.T,
      idle=makespan - busy.T - wait.T - delayed.T,
      staleness=_staleness(applied, reflected), task_times=task_times,
      applied=applied, update_seconds=update, comm=tuple(comm),
      samples_per_minibatch=(schedule.num_microbatches
                             * costs.samples_per_microbatch),
      costs=costs, extras=dict(runner.extras(), local_update_end=local_end),
      overlap=overlap.T)


def _reads_new_version(plan: Program) -> np.ndarray:
  """`[T]` whether a task reads a newer version than every earlier task of
  its stage (only then may it wait for the version to be in place: versions
  are applied in order, and the earlier task started after its own)."""
  out = np.zeros(len(plan.stage), bool)
  for s in np.unique(plan.stage):
    mine = np.flatnonzero(plan.stage == s)
    seen = np.maximum.accumulate(plan.version[mine])
    out[mine] = plan.version[mine] > np.concatenate([[-1], seen[:-1]])
  return out


def link_grid(cluster: cluster_lib.Cluster) -> tuple[np.ndarray, np.ndarray]:
  """`(latency, bandwidth)`, each `[S - 1, N]`: the link from stage b to b+1
  of each pipeline (one row of zeros and ones for a single stage)."""
  N, S = cluster.num_pipelines, cluster.num_stages
  latency, bandwidth = np.zeros((max(S - 1, 1), N)), np.ones((max(S - 1, 1), N))
  for i, row in enumerate(cluster.devices):
    for b in range(S - 1):
      link = cluster.link(row[b], row[b + 1])
      latency[b, i], bandwidth[b, i] = link.latency, link.bandwidth
  return latency, bandwidth


def _transfers(plan: Program, cluster: cluster_lib.Cluster,
               costs: cluster_lib.StageCosts
               ) -> tuple[np.ndarray, np.ndarray]:
  """`(rows, row_of)`: the distinct `[N]` link delays and each task's row.

  A task's input spends `latency + volume * bytes / bandwidth` on the link
  of its boundary, per pipeline; tasks without a link get row -1.
  """
  N = cluster.num_pipelines
  latency, bandwidth = link_grid(cluster)
  row_of = np.full(len(plan.stage), -1)
  has = plan.boundary >= 0
  if not has.any():
    return np.zeros((0, N)), row_of
  key = plan.boundary[has] * (plan.volume.max() + 1) + plan.volume[has]
  _, firsts, row_of[has] = np.unique(key, return_index=True,
                                     return_inverse=True)
  b = plan.boundary[has][firsts]
  volume = plan.volume[has][firsts] * np.asarray(costs.activation_bytes,
                                                 float)[b]
  rows = latency[b] + volume[:, None] / bandwidth[b]
  return rows, row_of


def _staleness(applied: np.ndarray, reflected: np.ndarray) -> np.ndarray:
  """`[N, B, S]`: updates in place anywhere before each, minus reflected
  (`[S, B, N]`, overwritten)."""
  _, B1, N = applied.shape
  index = np.arange((B1 - 1) * N)
  fresher = np.empty((N, B1 - 1), np.int64)
  for s in range(len(applied)):
    # Versions are applied in order on each pipeline: N sorted runs, which
    # a stable sort merges; an update's rank is that of its first equal.
    times = applied[s, 1:].T.ravel()
    order = np.argsort(times, kind="stable")
    ranked = times[order]
    first = np.empty(len(ranked), bool)
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    rank = np.where(first, index, 0)
    np.maximum.accumulate(rank, out=rank)
    fresher.ravel()[order] = rank
    np.subtract(fresher.T, reflected[s], out=reflected[s])
  return reflected.transpose(2, 1, 0)
