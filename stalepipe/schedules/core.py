"""Schedules as data: a table of tasks plus the weight version each task reads.

A schedule says what each pipeline stage does at each tick. It is plain Python,
with no JAX: the executors run it, the simulator times it, the renderers draw it
and the tests check it against the papers' closed forms.

Conventions (DESIGN.md): stages are numbered `0..S-1`, minibatches and
micro-batches from 0; a task takes one tick unless the schedule says otherwise.
A task's *version* is the number of optimizer updates of its stage reflected in
the weights it reads. A stage applies the update of minibatch `p` at the end of
the tick in which its last backward task of `p` finishes, in minibatch order.

A *device-level* schedule (interleaved 1F1B, ZB-V, DualPipeV) also names a
placement of its S stages on P devices (`placement.py`); each device runs at
most one task per tick, whichever of its stages (chunks) it belongs to, except
the two tasks of an overlapped forward-and-backward unit (DualPipe's F&B),
which start together and share the device. The per-stage figures keep their
meaning; the `device_*` figures sum a device's chunks.
"""

import bisect
import dataclasses
import functools
from typing import Mapping, NamedTuple

import numpy as np

from stalepipe.schedules import kinds as kinds_lib
from stalepipe.schedules import placement as placement_lib

KINDS = tuple(kinds_lib.KINDS)


class Task(NamedTuple):
  """One unit of work: `kind` of (`minibatch`, `microbatch`) on `stage`."""

  tick: int  # first tick the task occupies
  stage: int
  kind: str  # a name in `kinds.KINDS`: "F", "B", "FB", ...
  minibatch: int
  microbatch: int


VersionKey = tuple[int, int, str, int]  # (minibatch, stage, kind, microbatch)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """An immutable pipeline schedule: tasks plus the version map.

  Attributes:
    name: the schedule's registry name.
    num_stages: S.
    num_microbatches: M, micro-batches per minibatch.
    num_minibatches: B, minibatches in the table.
    tasks: every task, sorted by (tick, stage).
    versions: `(minibatch, stage, kind, microbatch) -> version` for every task.
    durations: ticks a task of each kind occupies (default: each kind's
      declared duration, F and B one, FB two).
    options: the schedule-specific options `make` was given.
    backward_covers_minibatch: whether each stage runs one backward per
      minibatch (micro-batch 0) on the mean loss of all its micro-batches,
      as TiMePReSt's nF1B does, instead of one backward per micro-batch.
    updates_together: whether every stage applies a minibatch's update at
      one tick, the end of the tick in which the last stage's last
      weight-gradient task of it ends (`together`), so that an update rule
      can see the whole model's gradient.
    placement: for a device-level schedule, the name of its placement
      (`placement.names()`) of the S stages on `num_devices` devices; None
      for a stage-level schedule (each stage its own lane).
    num_devices: P, for a device-level schedule.
    overlapped: (forward, backward) pairs of tasks that run as one unit on
      one device, both from the same tick (DualPipe's overlapped F&B); the
      device is busy until the later ends.
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_minibatches: int
  tasks: tuple[Task, ...]
  versions: Mapping[VersionKey, int]
  durations: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {k.name: k.duration
                               for k in kinds_lib.KINDS.values()})
  backward_covers_minibatch: bool = False
  options: Mapping[str, object] = dataclasses.field(default_factory=dict)
  updates_together: bool = False
  placement: str | None = None
  num_devices: int | None = None
  overlapped: tuple[tuple[Task, Task], ...] = ()

  def with_minibatches(self, num_minibatches: int) -> "Schedule":
    """The same schedule (name, sizes, options) over `num_minibatches`."""
    from stalepipe.schedules import make  # pylint: disable=g-import-not-at-top
    stream = make(self.name, num_stages=self.num_stages,
                  num_microbatches=self.num_microbatches,
                  num_minibatches=num_minibatches, **self.options)
    return dataclasses.replace(stream, updates_together=self.updates_together)

  def together(self) -> "Schedule":
    """This schedule with every stage applying minibatch p's update at one
    tick: the end of the tick in which its last weight-gradient task on any
    stage ends. Every task reads the same version as before.

    That holds exactly where the schedule finishes each minibatch's gradient
    on every stage before any stage reads that minibatch's update (GPipe,
    1F1B, zero-bubble's flush schedules): there an update rule may reduce
    over the whole model (global-norm clipping, full delay compensation's
    inner product) and equal unpipelined training.

    Raises:
      ValueError: where a task would read an update not yet applied (an
        asynchronous schedule), naming the first.
    """
    together = dataclasses.replace(self, updates_together=True)
    stream = together.with_minibatches(4 * self.num_minibatches)
    for t in stream.tasks:
      if stream.task_version(t) > stream.applied(t.stage, t.tick):
        raise ValueError(
            f"schedule {self.name!r} runs {t.kind} of minibatch "
            f"{t.minibatch} on stage {t.stage} on an update that another "
            "stage's gradient of the same minibatch is not yet finished for")
    return together

  def version(self, minibatch: int, stage: int, kind: str,
              microbatch: int = 0) -> int:
    """The weight version (updates of `stage` reflected) the task reads."""
    key = (minibatch, stage, kind, microbatch)
    if key not in self.versions:
      raise KeyError(f"no task {kind} of minibatch {minibatch} micro-batch "
                     f"{microbatch} on stage {stage} in schedule {self.name!r}")
    return self.versions[key]

  def task_version(self, task: Task) -> int:
    """The weight version `task` reads (see `version`)."""
    return self.version(task.minibatch, task.stage, task.kind, task.microbatch)

  def kind(self, task: Task) -> kinds_lib.TaskKind:
    """The `TaskKind` of `task`."""
    return kinds_lib.kind(task.kind)

  def covered_microbatches(self, task: Task) -> range:
    """The micro-batches `task` works on: all of its minibatch's for a
    backward that covers the minibatch (nF1B), else its own."""
    if self.backward_covers_minibatch and not self.kind(task).runs_forward:
      return range(self.num_microbatches)
    return range(task.microbatch, task.microbatch + 1)

  def end_tick(self, task: Task) -> int:
    """The first tick after `task` finishes."""
    return task.tick + self.durations[task.kind]

  def forward_version(self, stage: int, minibatch: int) -> int:
    """The oldest version the forwards of `minibatch` read on `stage`."""
    return min(v for (p, s, k, _), v in self.versions.items()
               if p == minibatch and s == stage and kinds_lib.kind(k).runs_forward)

  def gradient_version(self, stage: int, minibatch: int) -> int:
    """The version `minibatch`'s gradient was computed on, on `stage`: that
    of its first backward task (PipeDream with M > 1: the oldest)."""
    return min(v for (p, s, k, _), v in self.versions.items()
               if p == minibatch and s == stage and kinds_lib.kind(k).runs_backward)

  def update_version(self, stage: int, minibatch: int) -> int:
    """The version `minibatch`'s update is applied to (updates before it)."""
    return self.applied(stage, self.update_ticks[(stage, minibatch)])

  def ahead(self, task: Task) -> int:
    """Updates `task`'s stage applies between the version the task reads and
    its minibatch's own update (SpecTrain's s with staleness='minibatch';
    the paper's is `pipeline_ahead`)."""
    return (self.update_version(task.stage, task.minibatch)
            - self.task_version(task))

  def pipeline_ahead(self, task: Task) -> int:
    """SpecTrain's pipeline-wide staleness s of `task`.

    SpecTrain predicts one pipeline-wide version per minibatch: the weights
    every stage holds as the minibatch's backward reaches stage 0. On stage
    k of N that is :math:`\\lfloor k/2 \\rfloor + N - k - 1` updates ahead
    for a forward and :math:`\\lfloor k/2 \\rfloor` for a backward, the same
    for every minibatch: ntueclab/SpecTrain-PyTorch `src/optimizer.py:304-306`
    (`load_predicted_weights`, the paper's "version 1"; its README's figure
    `doc/v1.svg` derives it with a backward twice as long as a forward).
    Here it is applied as that code applies it, a fixed function of stage and
    pass whatever the ticks. `ahead` instead counts to the minibatch's own
    update on the task's stage (N-1-k and 0 once the pipeline is full).
    Defined only where the formula is (`pipeline_ahead_error`).

    Raises:
      ValueError: where `pipeline_ahead_error` names a reason.
    """
    if self.pipeline_ahead_error:
      raise ValueError(self.pipeline_ahead_error)
    k = task.stage
    forward = self.num_stages - 1 - k if self.kind(task).runs_forward else 0
    return k // 2 + forward

  @functools.cached_property
  def pipeline_ahead_error(self) -> str | None:
    """Why `pipeline_ahead` is undefined here, in one line; None where it is.

    SpecTrain's formula is for asynchronous 1F1B without weight stashing
    (every task reads its stage's latest weights, prediction replacing the
    stash) and one micro-batch per minibatch: `pipedream` with
    `weight_stashing=False`, `vertical_sync=False` and M = 1.
    """
    options = dict(self.options)
    if (self.name != "pipedream" or options.get("weight_stashing", True)
        or options.get("vertical_sync", False)):
      return (f"schedule {self.name!r} with options {options} has no SpecTrain "
              "pipeline-wide staleness; valid: 'pipedream' with "
              "weight_stashing=False (asynchronous 1F1B, every task on its "
              "stage's latest weights), or SpecTrain's staleness='minibatch'")
    if self.num_microbatches != 1:
      return (f"num_microbatches={self.num_microbatches} has no SpecTrain "
              "pipeline-wide staleness (its minibatch is one micro-batch); "
              "valid: 1, or SpecTrain's staleness='minibatch'")
    return None

  def since_forward(self, task: Task) -> int:
    """Updates between the version the task's forward read and the version
    the task reads (0 for a forward; PipeMare's tau_fwd - tau_bkwd)."""
    forward = min(self.versions[(task.minibatch, task.stage, k, m)]
                  for k in kinds_lib.names(lambda k: k.runs_forward)
                  for m in self.covered_microbatches(task)
                  if (task.minibatch, task.stage, k, m) in self.versions)
    return self.task_version(task) - forward

  @functools.cached_property
  def num_ticks(self) -> int:
    """Ticks from the first task's start to the last task's end."""
    return max(self.end_tick(t) for t in self.tasks)

  @functools.cached_property
  def busy(self) -> np.ndarray:
    """`busy[tick, stage]`: whether the stage works in that tick."""
    grid = np.zeros((self.num_ticks, self.num_stages), dtype=bool)
    for t in self.tasks:
      grid[t.tick:self.end_tick(t), t.stage] = True
    return grid

  @functools.cached_property
  def bubble_fraction(self) -> float:
    """Idle slots over all `num_ticks * num_stages` slots."""
    return 1.0 - float(self.busy.mean())

  @functools.cached_property
  def update_ticks(self) -> dict[tuple[int, int], int]:
    """`(stage, minibatch) -> tick` at whose end the stage applies the update."""
    last = {}
    for t in self.tasks:
      if self.kind(t).closes_update:
        key = (t.stage, t.minibatch)
        last[key] = max(last.get(key, -1), self.end_tick(t) - 1)
    if self.updates_together:
      done = {}
      for (_, p), u in last.items():
        done[p] = max(done.get(p, -1), u)
      last = {(s, p): done[p] for s, p in last}
    return last

  def applied(self, stage: int, tick: int) -> int:
    """Updates `stage` has applied before `tick` (its weights' version)."""
    return bisect.bisect_right(self._update_starts[stage], tick)

  @functools.cached_property
  def _update_starts(self) -> tuple[tuple[int, ...], ...]:
    """Per stage, the first tick of each version 1, 2, ... (update tick + 1)."""
    out = [[] for _ in range(self.num_stages)]
    for (s, _), u in sorted(self.update_ticks.items(), key=lambda kv: kv[1]):
      out[s].append(u + 1)
    return tuple(tuple(ticks) for ticks in out)

  @functools.cached_property
  def held(self) -> dict[tuple[int, int, int], tuple[int, int]]:
    """`(stage, minibatch, micro-batch) -> (first tick, end tick)` held.

    A micro-batch is held on a stage once, from the start of its first task
    there (its forward) to the end of its last (the last backward task that
    covers it), however many tasks the backward is split into.
    """
    held = {}
    for t in self.tasks:
      for m in self.covered_microbatches(t):
        key = (t.stage, t.minibatch, m)
        begin, end = held.get(key, (t.tick, self.end_tick(t)))
        held[key] = (min(begin, t.tick), max(end, self.end_tick(t)))
    return held

  @functools.cached_property
  def max_in_flight(self) -> tuple[int, ...]:
    """Per stage, the most micro-batches it holds at once (see `held`)."""
    count = np.zeros((self.num_ticks + 1, self.num_stages), dtype=int)
    for (s, _, _), (begin, end) in self.held.items():
      count[begin, s] += 1
      count[end, s] -= 1
    return tuple(int(x) for x in np.cumsum(count, axis=0).max(axis=0))

  @functools.cached_property
  def stash_depth(self) -> tuple[int, ...]:
    r"""Per stage, the most weight versions alive at once, the current one included.

    Version :math:`k` of a stage is alive from the tick it becomes current
    until it is superseded or until the last task reading it ends, whichever
    is later.
    """
    depth = []
    for s in range(self.num_stages):
      begins = (0,) + self._update_starts[s]
      ends = [b - 1 for b in begins[1:]] + [self.num_ticks - 1]
      for t in self.tasks:
        if t.stage == s:
          k = self.task_version(t)
          ends[k] = max(ends[k], self.end_tick(t) - 1)
      alive = np.zeros(self.num_ticks + 1, dtype=int)
      for b, e in zip(begins, ends):
        alive[b] += 1
        alive[e + 1] -= 1
      depth.append(int(np.cumsum(alive).max()))
    return tuple(depth)

  @functools.cached_property
  def placed(self) -> placement_lib.Placement | None:
    """The `Placement` of a device-level schedule; None for a stage-level one."""
    if self.placement is None:
      return None
    return placement_lib.make(self.placement, self.num_stages,
                              self.num_devices)

  def device(self, task: Task) -> int:
    """The device that runs `task` (its stage's, under `placed`)."""
    if self.placed is None:
      raise ValueError(f"schedule {self.name!r} has no placement; its tasks "
                       "run on stages, one lane each")
    return self._device_of[task.stage]

  @functools.cached_property
  def _device_of(self) -> tuple[int, ...]:
    return tuple(self.placed.where(s)[0] for s in range(self.num_stages))

  def _per_device(self, per_stage: np.ndarray) -> np.ndarray:
    """`per_stage[..., stage]` summed over each device's stages."""
    return np.stack([per_stage[..., self.placed.stages[d]].sum(axis=-1)
                     for d in range(self.num_devices)], axis=-1)

  @functools.cached_property
  def device_busy(self) -> np.ndarray:
    """`device_busy[tick, device]`: whether the device works in that tick."""
    return self._per_device(self.busy) > 0

  @functools.cached_property
  def device_bubble_fraction(self) -> float:
    """Idle device ticks over all `num_ticks * num_devices`."""
    return 1.0 - float(self.device_busy.mean())

  @functools.cached_property
  def device_max_in_flight(self) -> tuple[int, ...]:
    """Per device, the most micro-batches its stages hold at once (the sum
    over its stages at each tick, the maximum over ticks)."""
    count = np.zeros((self.num_ticks + 1, self.num_stages), dtype=int)
    for (s, _, _), (begin, end) in self.held.items():
      count[begin, s] += 1
      count[end, s] -= 1
    held = self._per_device(np.cumsum(count, axis=0))
    return tuple(int(x) for x in held.max(axis=0))

  @functools.cached_property
  def device_stash_depth(self) -> tuple[int, ...]:
    """Per device, the weight versions its stages keep (`stash_depth` summed
    over its stages)."""
    return tuple(int(x) for x in self._per_device(np.array(self.stash_depth)))

  @functools.cached_property
  def staleness(self) -> tuple[int, ...]:
    r"""Per minibatch :math:`p`, the most updates of minibatches before it that
    one of its tasks misses: :math:`\max_{\text{tasks}} (p - \text{version})`."""
    worst = [0] * self.num_minibatches
    for t in self.tasks:
      worst[t.minibatch] = max(worst[t.minibatch],
                               t.minibatch - self.task_version(t))
    return tuple(worst)

  @functools.cached_property
  def version_difference(self) -> int:
    r"""TiMePReSt's :math:`v` (seed 003 §4.4), measured.

    The gradient of minibatch :math:`p` is computed on weights holding the
    updates of minibatches :math:`0..p-v`, so successive updates form
    :math:`v` interleaved sequences; :math:`v = 1` is a single sequence.

    .. math:: v = 1 + \max_{\text{backward tasks}} (p - \text{version})
    """
    return 1 + max(t.minibatch - self.task_version(t) for t in self.tasks
                   if self.kind(t).runs_backward)

  def validate(self) -> "Schedule":
    """Checks the dependencies and the version rule; returns the schedule.

    Raises:
      ValueError: naming the first task that breaks a rule.
    """
    S, M, B = self.num_stages, self.num_microbatches, self.num_minibatches
    if list(self.tasks) != sorted(self.tasks, key=lambda t: (t.tick, t.stage)):
      raise ValueError(f"tasks of schedule {self.name!r} are not sorted by "
                       "(tick, stage)")
    ends, occupied = {}, {}
    made = {}  # (minibatch, stage, micro-batch, what) -> end of its producer
    for t in self.tasks:
      if (t.kind not in KINDS or not 0 <= t.stage < S
          or not 0 <= t.minibatch < B or not 0 <= t.microbatch < M
          or t.tick < 0):
        raise ValueError(f"{t} is invalid: kind must be one of {KINDS}, "
                         f"stage < {S}, minibatch < {B}, micro-batch < {M}, "
                         "tick >= 0")
      if self.kind(t).last_stage_only and t.stage != S - 1:
        raise ValueError(f"{t} is invalid: only the last stage {S - 1} runs "
                         f"{self.kind(t).description}")
      key = (t.minibatch, t.stage, t.kind, t.microbatch)
      if key in ends:
        raise ValueError(f"{t} appears twice")
      if key not in self.versions:
        raise ValueError(f"{t} has no version")
      ends[key] = self.end_tick(t)
      for what in self.kind(t).produces:
        for m in self.covered_microbatches(t):
          made[(t.minibatch, t.stage, m, what)] = self.end_tick(t)
      for tick in range(t.tick, self.end_tick(t)):
        if (t.stage, tick) in occupied:
          raise ValueError(f"{t} overlaps {occupied[(t.stage, tick)]} on "
                           f"stage {t.stage} at tick {tick}")
        occupied[(t.stage, tick)] = t
    if self.placed is not None:
      self._validate_devices()

    def end(p, s, m, what):
      if (p, s, m, what) not in made:
        raise ValueError(f"schedule {self.name!r} lacks the task making the "
                         f"{what} of minibatch {p} micro-batch {m} on stage "
                         f"{s}")
      return made[(p, s, m, what)]

    for p in range(B):
      for s in range(S):
        for m in range(M):
          end(p, s, m, kinds_lib.OUTPUT)
          end(p, s, m, kinds_lib.WEIGHT_GRADIENT)
          if s > 0:
            end(p, s, m, kinds_lib.INPUT_COTANGENT)
    extra = set(self.versions) - set(ends)
    if extra:
      raise ValueError(f"versions name tasks that are not scheduled: "
                       f"{sorted(extra)[:3]}")
    for t in self.tasks:
      p, s, m, k = t.minibatch, t.stage, t.microbatch, self.kind(t)
      needs = []  # (what, stage, micro-batch)
      if k.runs_forward and s > 0:
        needs.append((kinds_lib.OUTPUT, s - 1, m))
      for mm in self.covered_microbatches(t):
        if kinds_lib.INPUT in k.consumes and not k.runs_forward:
          needs.append((kinds_lib.OUTPUT, s, mm))
        if kinds_lib.OUTPUT_COTANGENT in k.consumes and s < S - 1:
          needs.append((kinds_lib.INPUT_COTANGENT, s + 1, mm))
      for what, stage, mm in needs:
        if end(p, stage, mm, what) > t.tick:
          raise ValueError(f"{t} starts before the {what} of minibatch {p} "
                           f"micro-batch {mm} on stage {stage} is made")
      version, applied = self.task_version(t), self.applied(s, t.tick)
      if not 0 <= version <= applied:
        raise ValueError(f"{t} reads version {version} but stage {s} has "
                         f"applied {applied} updates before tick {t.tick}")
    for s in range(S):
      ticks = [self.update_ticks[(s, p)] for p in range(B)]
      for p in range(1, B):
        if ticks[p] <= ticks[p - 1]:
          raise ValueError(f"stage {s} applies the update of minibatch {p} "
                           f"(tick {ticks[p]}) before that of minibatch "
                           f"{p - 1} (tick {ticks[p - 1]})")
    return self

  def _validate_devices(self) -> None:
    """A device runs at most one task per tick, but for an overlapped unit."""
    units = {frozenset(pair) for pair in self.overlapped}
    for f, b in self.overlapped:
      if (f.tick != b.tick or self.device(f) != self.device(b)
          or not self.kind(f).runs_forward or self.kind(b).runs_forward):
        raise ValueError(f"overlapped pair ({f}, {b}) is invalid: a forward "
                         "and a backward on one device from one tick")
    tasks = set(self.tasks)
    missing = [t for pair in self.overlapped for t in pair if t not in tasks]
    if missing:
      raise ValueError(f"overlapped {missing[0]} is not scheduled")
    occupied = {}
    for t in self.tasks:
      d = self.device(t)
      for tick in range(t.tick, self.end_tick(t)):
        other = occupied.get((d, tick))
        if other is not None and frozenset((t, other)) not in units:
          raise ValueError(f"{t} clashes with {other} on device {d} at tick "
                           f"{tick}")
        occupied.setdefault((d, tick), t)
