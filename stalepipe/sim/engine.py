r"""Discrete-event simulation of a schedule plus a sync policy on a cluster.

Every pipeline replays the schedule's per-stage task order (the order of
`schedule.tasks` on each stage) with durations from the cost model. A task
starts when all of these hold:

- its device is free: after the previous task of the stage; before the
  first task of an iteration, also after the worker's own sync of its last
  update (Algorithm 1 of seed 002: step B ends an iteration) and a
  straggler's sleep;
- its input has arrived: F(p, m) on `s` after F(p, m) on `s-1` plus the
  activation transfer, B(p, m) on `s` after B/FB(p, m) on `s+1` plus the
  gradient transfer, a last-stage B after its own F;
- the version it reads is in place: stage `s` has applied that many updates
  (the update of minibatch `p` follows the last backward of `p` on `s`, in
  minibatch order, and then the sync policy's exchange);
- the sync policy's gate, if any (WSP's clock distance).

.. math::

  \text{start} = \max(\text{free} + \text{sleep},\ \text{input} +
  \text{transfer},\ \text{applied}_{s,v},\ \text{gate}),\quad
  \text{end} = \text{start}
  + \frac{c_{kind,s} \cdot \text{slowdown}}{\text{speed}}

Since every pipeline runs the same per-stage order, each task is one NumPy
operation over all pipelines; events are processed in the schedule's task
order, which is a topological order of these dependencies. Pipelines only
meet at syncs, where the policy sees all ready times at once.

References:
  Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §4-§5;
  Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023, §3, §5
"""

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from stalepipe.schedules import core
from stalepipe.schedules import kinds
from stalepipe.sim import cluster as cluster_lib
from stalepipe.sim import policy as policy_lib
from stalepipe.sim import stragglers as stragglers_lib


class _Plan(NamedTuple):
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
  backward_version: np.ndarray  # [S, B] oldest version a backward reads
  first_task: np.ndarray  # [S, B] index of the first task


def _compile(schedule: core.Schedule, costs: cluster_lib.StageCosts) -> _Plan:
  S, B = schedule.num_stages, schedule.num_minibatches
  tasks = schedule.tasks
  T = len(tasks)
  fwd, bwd = {}, {}
  for i, t in enumerate(tasks):
    if schedule.kind(t).runs_forward:
      fwd[(t.minibatch, t.microbatch, t.stage)] = i
    if kinds.INPUT_COTANGENT in schedule.kind(t).produces:
      bwd[(t.minibatch, t.microbatch, t.stage)] = i
  plan = {k: np.full(T, -1) for k in ("stage", "minibatch", "dep", "boundary",
                                      "version")}
  volume, base = np.zeros(T), np.zeros(T)
  first, trigger = np.zeros(T, bool), np.zeros(T, bool)
  backward_version = np.full((S, B), np.iinfo(np.int64).max)
  first_task = np.full((S, B), -1)
  last_backward = np.full((S, B), -1)
  own, triggered = np.zeros(T, int), [0] * S
  for i, t in enumerate(tasks):
    s, p, m = t.stage, t.minibatch, t.microbatch
    plan["stage"][i], plan["minibatch"][i] = s, p
    plan["version"][i] = v = schedule.task_version(t)
    if first_task[s, p] < 0:
      first_task[s, p], first[i] = i, True
    kind, covered = schedule.kind(t), schedule.covered_microbatches(t)
    base[i] = costs.seconds(kind, s) * len(covered)
    if kind.runs_forward and s > 0:
      dep, plan["boundary"][i], volume[i] = fwd.get((p, m, s - 1)), s - 1, 1
    elif kinds.OUTPUT_COTANGENT in kind.consumes and s < S - 1:
      dep, plan["boundary"][i] = bwd.get((p, m, s + 1)), s
      volume[i] = len(covered)
    elif not kind.runs_forward:
      dep = fwd.get((p, covered[-1], s))
    else:  # a forward on stage 0 reads the data
      dep = -1
    if dep != -1:
      if dep is None or dep >= i:
        raise ValueError(f"{t} of schedule {schedule.name!r} runs before the "
                         "task whose output it needs")
      plan["dep"][i] = dep
    if kind.closes_update:
      last_backward[s, p] = i
    if kind.runs_backward:
      backward_version[s, p] = min(backward_version[s, p], v)
  trigger[last_backward[last_backward >= 0]] = True
  for s in range(S):
    order = last_backward[s]
    if (order < 0).any() or (np.diff(order) <= 0).any():
      raise ValueError(f"stage {s} of schedule {schedule.name!r} must finish "
                       "the backwards of its minibatches in minibatch order")
  for i, t in enumerate(tasks):
    own[i] = triggered[t.stage]
    triggered[t.stage] += int(trigger[i])
    v = plan["version"][i]
    if v > 0 and last_backward[t.stage, v - 1] >= i:
      raise ValueError(f"{t} reads version {v} before stage {t.stage} applies "
                       f"the update of minibatch {v - 1}")
  return _Plan(volume=volume, first=first, own=own, trigger=trigger, base=base,
               backward_version=backward_version, first_task=first_task,
               **plan)


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What a simulation measured; seconds, devices as `[pipeline, stage]`.

  Attributes:
    schedule: the schedule every pipeline ran.
    cluster: the cluster it ran on.
    policy: the sync policy's name.
    makespan: seconds until the last update is in place everywhere.
    busy: `[N, S]` seconds computing (tasks and updates).
    wait: `[N, S]` seconds a device waited for a sync: its own at the end of
      an iteration, or, with its input in, for the version it reads or a
      gate.
    delayed: `[N, S]` seconds of injected straggler sleeps.
    idle: `[N, S]` the rest of the makespan (pipeline bubbles, link delays).
    staleness: `[N, B, S]` observed staleness of each minibatch's gradient:
      updates (of any replica) in place before it is applied, minus those
      reflected in the weights its backward read.
    start, end, ready: `[tasks, N]` each task's start, end and the time its
      device was free with its input in.
    blocked, sleep_at, sleep: `[tasks, N]` for the first task of an
      iteration, the seconds its device waited for its own sync, when its
      injected sleep began and how long it lasted.
    applied: `[S, B + 1, N]` when version `v` of a stage is in place.
    comm: `(stage, CommEvent)` records of every exchange.
    samples_per_minibatch: M x samples per micro-batch.
    extras: policy records (WSP clocks, SDPipe groups, ...).
  """

  schedule: core.Schedule
  cluster: cluster_lib.Cluster
  policy: str
  makespan: float
  busy: np.ndarray
  wait: np.ndarray
  delayed: np.ndarray
  idle: np.ndarray
  staleness: np.ndarray
  start: np.ndarray
  end: np.ndarray
  ready: np.ndarray
  blocked: np.ndarray
  sleep_at: np.ndarray
  sleep: np.ndarray
  applied: np.ndarray
  update_seconds: np.ndarray
  comm: tuple
  samples_per_minibatch: int
  costs: cluster_lib.StageCosts
  extras: dict

  @property
  def minibatches_per_second(self) -> float:
    return self.applied.shape[2] * self.schedule.num_minibatches / self.makespan

  @property
  def samples_per_second(self) -> float:
    return self.minibatches_per_second * self.samples_per_minibatch

  def steady_samples_per_second(self, skip: int) -> float:
    """Samples/s between minibatch `skip - 1`'s and the last one's updates.

    Leaves out the pipeline fill (and any warm-up) of the first `skip`
    minibatches.
    """
    B = self.schedule.num_minibatches
    if not 0 < skip < B:
      raise ValueError(f"skip={skip!r} is invalid; it must be in [1, {B - 1}]")
    t0 = self.applied[:, skip].max()
    t1 = self.applied[:, B].max()
    N = self.applied.shape[2]
    return N * (B - skip) * self.samples_per_minibatch / (t1 - t0)

  @property
  def memory_required(self) -> np.ndarray | None:
    """`[S]` bytes a stage holds at its peak, if the schedule reports it.

    Weight versions alive x parameter bytes + micro-batches in flight x
    activation bytes (`stash_depth`, `max_in_flight`).
    """
    stash = getattr(self.schedule, "stash_depth", None)
    in_flight = getattr(self.schedule, "max_in_flight", None)
    if stash is None or in_flight is None:
      return None
    return (np.asarray(self.costs.param_bytes) * np.asarray(stash)
            + np.asarray(self.costs.activation_bytes) * np.asarray(in_flight))

  @property
  def fits(self) -> np.ndarray | None:
    """`[N, S]` whether each device's memory holds its stage's peak."""
    if self.memory_required is None:
      return None
    memory = np.array([[d.memory_bytes for d in row]
                       for row in self.cluster.devices])
    return memory >= self.memory_required[None]

  def timeline(self, pipelines: Sequence[int] | None = None,
               until: float = np.inf) -> list:
    """The run as `render.TimelineEvent`s (seconds) for the renderers.

    Args:
      pipelines: the pipelines to show (default all).
      until: leave out events starting at or after this time.

    Returns:
      Tasks (their kind's name: "F", "B", "BI", ...), updates ("U"),
      communication ("C"), waits for a sync, a version or a gate ("W") and
      injected straggler sleeps ("W" labelled "sleep"), one row per device.
    """
    # pylint: disable-next=g-import-not-at-top
    from stalepipe.schedules import render
    N = self.applied.shape[2]
    shown = range(N) if pipelines is None else pipelines
    width = len(str(N - 1))

    def row(i, s):
      return f"pipeline {i:0{width}d} stage {s}"

    events = []
    M = self.schedule.num_microbatches
    for k, t in enumerate(self.schedule.tasks):
      label = f"{t.minibatch}.{t.microbatch}" if M > 1 else f"{t.minibatch}"
      for i in shown:
        st, en, rd = self.start[k, i], self.end[k, i], self.ready[k, i]
        if rd >= until:
          continue
        slept, held = self.sleep_at[k, i], self.blocked[k, i]
        if held > 0:
          events.append(render.TimelineEvent(row(i, t.stage), slept - held,
                                             held, "W", ""))
        d = self.sleep[k, i]
        if d > 0:
          events.append(render.TimelineEvent(row(i, t.stage), slept, d, "W",
                                             "sleep"))
        if st > rd:
          events.append(render.TimelineEvent(row(i, t.stage), rd, st - rd,
                                             "W", ""))
        if st < until:
          events.append(render.TimelineEvent(row(i, t.stage), st, en - st,
                                             t.kind, label))
    S, B = self.schedule.num_stages, self.schedule.num_minibatches
    for s in range(S):
      for p in range(B):
        for i in shown:
          u = self.update_seconds[p, s, i]
          t0 = self.applied_local[s, p, i]
          if u > 0 and t0 - u < until:
            events.append(render.TimelineEvent(row(i, s), t0 - u, u, "U",
                                               str(p)))
    for s, event in self.comm:
      for i, st, en in zip(event.pipelines, event.start, event.end):
        if i in shown and st < until:
          events.append(render.TimelineEvent(row(int(i), s), float(st),
                                             float(en - st), "C", ""))
    return events

  @property
  def applied_local(self) -> np.ndarray:
    """`[S, B, N]` when each stage's own update of each minibatch finished."""
    return self.extras["local_update_end"]


def simulate(schedule: core.Schedule, cluster: cluster_lib.Cluster,
             costs: cluster_lib.StageCosts,
             policy=None, *,
             perturbations: Sequence = (), seed: int = 0) -> SimResult:
  """Times `schedule` on every pipeline of `cluster` under a sync policy.

  Args:
    schedule: the per-pipeline schedule (`stalepipe.schedules.make`), built
      for the number of minibatches to simulate.
    cluster: `[pipelines][stages]` devices and links.
    costs: per-stage costs on the reference device.
    policy: a sync policy (`bsp()`, `wsp(D, N_m)`, `sdpipe(P, T)`, ...);
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
  S, B = schedule.num_stages, schedule.num_minibatches
  N = cluster.num_pipelines
  if cluster.num_stages != S or costs.num_stages != S:
    raise ValueError(f"cluster has {cluster.num_stages} stages and costs "
                     f"{costs.num_stages}; the schedule has {S}")
  policy = policy or policy_lib.isolated()
  plan = _compile(schedule, costs)
  straggler_rng, policy_rng = np.random.default_rng(seed).spawn(2)
  delay, multiplier = stragglers_lib.slowdowns(perturbations, (B, N, S),
                                               straggler_rng)
  speed = cluster.speed  # [N, S]
  scale = np.ascontiguousarray((multiplier / speed[None]).transpose(0, 2, 1))
  delay = np.ascontiguousarray(delay.transpose(0, 2, 1))  # [B, S, N]
  update = np.asarray(costs.update)[None, :, None] * scale  # [B, S, N]
  xfer = _transfers(plan, cluster, costs)
  ctx = policy_lib.Context(cluster, costs, B, policy_rng)
  runner = policy.start(ctx)

  T = len(plan.stage)
  start, end = np.zeros((T + 1, N)), np.zeros((T + 1, N))
  ready = np.zeros((T, N))
  blocked, sleep_at, sleep = (np.zeros((T, N)) for _ in range(3))
  free = np.zeros((S, N))
  applied = np.full((S, B + 1, N), np.inf)
  applied[:, 0] = 0.0
  local_end = np.zeros((S, B, N))
  # know[s][i, j]: updates of replica j that replica i's stage s reflects,
  # kept for the versions a later backward may still read (a ring buffer).
  know = np.zeros((S, N, N), dtype=np.int64)
  depth = int((np.arange(1, B + 1)[None] - plan.backward_version).max()) + 1
  history = np.zeros((S, depth, N, N), dtype=np.int64)
  reflected = np.zeros((S, B, N), dtype=np.int64)
  diagonal = np.arange(N)
  comm = []
  stage, minibatch, dep = plan.stage.tolist(), plan.minibatch.tolist(), plan.dep
  version, first, trigger = plan.version.tolist(), plan.first, plan.trigger
  base, gates, own = plan.base, runner.gates, plan.own
  for i in range(T):
    s, p = stage[i], minibatch[i]
    f = free[s]
    if first[i]:
      synced = np.maximum(f, applied[s, own[i]])
      blocked[i], sleep_at[i], sleep[i] = synced - f, synced, delay[p, s]
      f = synced + sleep[i]
    r = np.maximum(f, end[dep[i]] + xfer[i])
    st = np.maximum(r, applied[s, version[i]])
    if gates and first[i]:
      st = np.maximum(st, runner.gate(s, p))
    e = st + base[i] * scale[p, s]
    ready[i], start[i], end[i] = r, st, e
    if not trigger[i]:
      free[s] = e
      continue
    e = e + update[p, s]
    free[s] = local_end[s, p] = e
    out = runner.sync(s, p, e)
    applied[s, p + 1] = np.maximum(out.applied, applied[s, p])
    read = history[s, plan.backward_version[s, p] % depth]
    floor = runner.floor(s, start[plan.first_task[s, p]])
    reflected[s, p] = np.maximum(read, floor[:, None]).sum(axis=1)
    k = know[s]
    k[diagonal, diagonal] = p + 1
    for g in out.groups:
      k[g] = k[g].max(axis=0)
    history[s, (p + 1) % depth] = k
    comm.extend((s, c) for c in out.comm)

  start, end = start[:T], end[:T]
  makespan = float(max(applied[:, B].max(), end.max()))
  busy = np.zeros((S, N))
  wait = np.zeros((S, N))
  for s in range(S):
    mine = plan.stage == s
    busy[s] = (end[mine] - start[mine]).sum(0)
    wait[s] = (start[mine] - ready[mine] + blocked[mine]).sum(0)
  busy += update.sum(0)
  delayed = delay.sum(0)
  staleness = _staleness(applied, reflected)
  extras = dict(runner.extras(), local_update_end=local_end)
  return SimResult(
      schedule=schedule, cluster=cluster, policy=policy.name,
      makespan=makespan, busy=busy.T, wait=wait.T, delayed=delayed.T,
      idle=makespan - busy.T - wait.T - delayed.T, staleness=staleness,
      start=start, end=end, ready=ready, blocked=blocked, sleep_at=sleep_at,
      sleep=sleep, applied=applied, update_seconds=update,
      comm=tuple(comm),
      samples_per_minibatch=(schedule.num_microbatches
                             * costs.samples_per_microbatch),
      costs=costs, extras=extras)


def _transfers(plan: _Plan, cluster: cluster_lib.Cluster,
               costs: cluster_lib.StageCosts) -> np.ndarray:
  """`[T, N]` seconds each task's input spends on the link (0 without one)."""
  N, S = cluster.num_pipelines, cluster.num_stages
  latency, bandwidth = np.zeros((max(S - 1, 1), N)), np.ones((max(S - 1, 1), N))
  for i, row in enumerate(cluster.devices):
    for b in range(S - 1):
      link = cluster.link(row[b], row[b + 1])
      latency[b, i], bandwidth[b, i] = link.latency, link.bandwidth
  xfer = np.zeros((len(plan.stage), N))
  has = plan.boundary >= 0
  b = plan.boundary[has]
  volume = plan.volume[has] * np.asarray(costs.activation_bytes)[b]
  xfer[has] = latency[b] + volume[:, None] / bandwidth[b]
  return xfer


def _staleness(applied: np.ndarray, reflected: np.ndarray) -> np.ndarray:
  """`[N, B, S]`: updates in place anywhere before each, minus reflected."""
  S, B1, _ = applied.shape
  out = np.zeros((S, B1 - 1, applied.shape[2]), dtype=np.int64)
  for s in range(S):
    times = applied[s, 1:]
    fresher = np.searchsorted(np.sort(times, axis=None), times, side="left")
    out[s] = fresher - reflected[s]
  return out.transpose(2, 1, 0)
