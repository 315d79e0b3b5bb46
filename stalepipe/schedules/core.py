"""Schedules as data: a table of tasks plus the weight version each task reads.

A schedule says what each pipeline stage does at each tick. It is plain Python,
with no JAX: the executors run it, the simulator times it, the renderers draw it
and the tests check it against the papers' closed forms.

Conventions (DESIGN.md): stages are numbered `0..S-1`, minibatches and
micro-batches from 0; a task takes one tick unless the schedule says otherwise.
A task's *version* is the number of optimizer updates of its stage reflected in
the weights it reads. A stage applies the update of minibatch `p` at the end of
the tick in which its last backward task of `p` finishes, in minibatch order.
"""

import dataclasses
import functools
from typing import Mapping, NamedTuple

import numpy as np

KINDS = ("F", "B", "FB")


class Task(NamedTuple):
  """One unit of work: `kind` of (`minibatch`, `microbatch`) on `stage`."""

  tick: int  # first tick the task occupies
  stage: int
  kind: str  # "F" forward, "B" backward, "FB" fused forward and backward
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
    durations: ticks a task of each kind occupies (default one each).
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_minibatches: int
  tasks: tuple[Task, ...]
  versions: Mapping[VersionKey, int]
  durations: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {"F": 1, "B": 1, "FB": 2})

  def version(self, minibatch: int, stage: int, kind: str,
              microbatch: int = 0) -> int:
    """The weight version (updates of `stage` reflected) the task reads."""
    key = (minibatch, stage, kind, microbatch)
    if key not in self.versions:
      raise KeyError(f"no task {kind} of minibatch {minibatch} micro-batch "
                     f"{microbatch} on stage {stage} in schedule {self.name!r}")
    return self.versions[key]

  def task_version(self, task: Task) -> int:
    return self.version(task.minibatch, task.stage, task.kind, task.microbatch)

  def end_tick(self, task: Task) -> int:
    """The first tick after `task` finishes."""
    return task.tick + self.durations[task.kind]

  @functools.cached_property
  def num_ticks(self) -> int:
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
      if t.kind in ("B", "FB"):
        key = (t.stage, t.minibatch)
        last[key] = max(last.get(key, -1), self.end_tick(t) - 1)
    return last
