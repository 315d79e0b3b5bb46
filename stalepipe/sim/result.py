"""What a simulation measured (`SimResult`), whichever engine ran it."""

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import numpy as np

from stalepipe.schedules import core
from stalepipe.sim import cluster as cluster_lib


class TaskTimes(NamedTuple):
  """`[tasks, N]` seconds of every task on every pipeline."""

  start: np.ndarray  # when it started
  end: np.ndarray  # when it ended
  ready: np.ndarray  # when its device was free with its input in
  blocked: np.ndarray  # first task of an iteration: waited for its own sync
  sleep_at: np.ndarray  # first task of an iteration: its sleep began
  sleep: np.ndarray  # first task of an iteration: the injected sleep


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What a simulation measured; seconds, devices as `[pipeline, stage]`.

  A device-level schedule's stages (chunks) share devices: the per-stage
  figures are each chunk's, and `device_busy`, `device_wait`,
  `device_delayed`, `device_idle` (`[N, P]`) its devices'; for a stage-level
  schedule they are the per-stage figures.

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
    task_times: the `TaskTimes`, or a function computing them: a run of
      1,024 workers keeps its syncs and computes its task times (gigabytes)
      on first use of `start`, `end`, `ready`, `blocked`, `sleep_at` or
      `sleep`.
    applied: `[S, B + 1, N]` when version `v` of a stage is in place.
    comm: `(stage, CommEvent)` records of every exchange.
    samples_per_minibatch: M x samples per micro-batch.
    extras: policy records (WSP clocks, SDPipe groups, ...).
    overlap: `[N, P]` seconds each device ran the two tasks of an overlapped
      pair (DualPipe's F&B) together: `min(F, B)` per pair.
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
  task_times: TaskTimes | Callable[[], TaskTimes]
  applied: np.ndarray
  update_seconds: np.ndarray
  comm: tuple
  samples_per_minibatch: int
  costs: cluster_lib.StageCosts
  extras: dict
  overlap: np.ndarray

  @functools.cached_property
  def _times(self) -> TaskTimes:
    if isinstance(self.task_times, TaskTimes):
      return self.task_times
    return self.task_times()

  @property
  def start(self) -> np.ndarray:
    """`[tasks, N]` when each task started."""
    return self._times.start

  @property
  def end(self) -> np.ndarray:
    """`[tasks, N]` when each task ended."""
    return self._times.end

  @property
  def ready(self) -> np.ndarray:
    """`[tasks, N]` when each task's device was free with its input in."""
    return self._times.ready

  @property
  def blocked(self) -> np.ndarray:
    """`[tasks, N]` for an iteration's first task, the seconds its device
    waited for its own sync."""
    return self._times.blocked

  @property
  def sleep_at(self) -> np.ndarray:
    """`[tasks, N]` for an iteration's first task, when its injected sleep
    began."""
    return self._times.sleep_at

  @property
  def sleep(self) -> np.ndarray:
    """`[tasks, N]` for an iteration's first task, its injected sleep."""
    return self._times.sleep

  def _per_device(self, per_stage: np.ndarray) -> np.ndarray:
    """`[N, S]` figures summed over each device's stages: `[N, P]`."""
    placed = self.schedule.placed
    if placed is None:
      return per_stage
    return per_stage[:, placed.stages].sum(axis=-1)

  @property
  def device_busy(self) -> np.ndarray:
    """`[N, P]` seconds each device computed: its stages' `busy`, less the
    time overlapped pairs ran together (a pair takes `max(F, B)`)."""
    return self._per_device(self.busy) - self.overlap

  @property
  def device_wait(self) -> np.ndarray:
    """`[N, P]` its stages' `wait` (their tasks wait one after another;
    the two tasks of an overlapped pair each count theirs)."""
    return self._per_device(self.wait)

  @property
  def device_delayed(self) -> np.ndarray:
    """`[N, P]` injected sleeps (one per device and minibatch)."""
    return self._per_device(self.delayed)

  @property
  def device_idle(self) -> np.ndarray:
    """`[N, P]` the rest of the makespan: bubbles and link delays."""
    return (self.makespan - self.device_busy - self.device_wait
            - self.device_delayed)

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
    """`[N, S]` (device-level: `[N, P]`) whether each device's memory holds
    its stage's peak (the sum of its chunks' peaks)."""
    if self.memory_required is None:
      return None
    memory = np.array([[d.memory_bytes for d in row]
                       for row in self.cluster.devices])
    return memory >= self._per_device(self.memory_required[None])

  def timeline(self, pipelines: Sequence[int] | None = None,
               until: float = np.inf) -> list:
    """The run as `render.TimelineEvent`s (seconds) for the renderers.

    Args:
      pipelines: the pipelines to show (default all).
      until: leave out events starting at or after this time.

    Returns:
      Tasks (their kind's name: "F", "B", "BI", ...), updates ("U"),
      communication ("C"), waits for a sync, a version or a gate ("W") and
      injected straggler sleeps ("W" labelled "sleep"), one row per device
      (a device-level schedule's chunks share their device's row).
    """
    # pylint: disable-next=g-import-not-at-top
    from stalepipe.schedules import render
    N = self.applied.shape[2]
    shown = range(N) if pipelines is None else pipelines
    width = len(str(N - 1))
    placed = self.schedule.placed
    unit = "stage" if placed is None else "device"
    on = (range(self.schedule.num_stages) if placed is None
          else [placed.where(s)[0] for s in range(self.schedule.num_stages)])

    def row(i, s):
      return f"pipeline {i:0{width}d} {unit} {on[s]}"

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
  def ready_times(self) -> np.ndarray:
    """`[B, S, N]` when each worker's own update was done (its ready signal):
    the trace `stalepipe.sync.sdpipe(..., ready_times=)` replays."""
    return self.applied_local.transpose(1, 0, 2)

  @property
  def applied_local(self) -> np.ndarray:
    """`[S, B, N]` when each stage's own update of each minibatch finished."""
    return self.extras["local_update_end"]
