"""Compiling a schedule into per-tick instruction tables for the executor.

The executor is one SPMD program that scans over the ticks of a *window* (the
schedule's B minibatches); at each tick every stage reads its own row of the
tables and does that task. Asynchronous schedules keep work in flight across
windows, so a window is cut from the schedule of an endless stream of
minibatches: window k holds every task from the stage-0 forward of minibatch
kB up to, not including, that of minibatch (k+1)B. Everything a table names is
relative (minibatch within the window's input history, weight version as a lag
behind the stage's latest, buffer slot as an offset from the window's first),
so after a warm-up
every window's table is the same and one compiled program runs them all.
Everything here is NumPy and runs once, when a pipeline is built.
"""

import math
from typing import NamedTuple

import numpy as np

from stalepipe.schedules import Schedule

IDLE, FORWARD, BACKWARD, FUSED = 0, 1, 2, 3
KIND_CODES = {"F": FORWARD, "B": BACKWARD, "FB": FUSED}
FIELDS = (
    "kind",  # IDLE, FORWARD, BACKWARD or FUSED
    "minibatch",  # index into the window's input history, [0, (H+1)B)
    "microbatch",
    "slot",  # buffer slot of the task's (first) micro-batch, less k*B*M mod C
    "lag",  # the version read is `latest - lag` (latest: updates applied)
    "recv_forward",  # slot for the activation arriving this tick, or -1
    "recv_backward",  # slot for the cotangents arriving this tick, or -1
    "update",  # 1: apply the minibatch's update at the end of this tick
    "update_lag",  # the version its gradient was computed on, as a lag
    "evict",  # the version the update overwrites, as a lag; -1: an empty slot
    "update_minibatch",  # the updated minibatch, indexed like "minibatch"
)
_MAX_WINDOWS = 64


class Program(NamedTuple):
  """A schedule compiled for the executor."""

  tables: np.ndarray  # [K, T, S, len(FIELDS)] int32; window k >= K-1 uses [-1]
  num_slots: int  # C: activation/cotangent buffer slots per stage
  num_versions: int  # R: weight versions a stage keeps (its stash ring)
  history: int  # H: earlier windows whose inputs tasks still read
  backward_width: int  # micro-batches one backward covers (M for nF1B)


def _window_starts(schedule: Schedule, B: int, K: int) -> list[int]:
  """First tick of windows 0..K: the stage-0 forward of minibatch kB."""
  first = {t.minibatch: t.tick for t in schedule.tasks
           if t.stage == 0 and t.kind in ("F", "FB") and t.microbatch == 0}
  return [first[k * B] for k in range(K + 1)]


def _live_intervals(schedule: Schedule) -> dict[int, list]:
  """Per stage, (first tick, last tick, global micro-batch) a slot is held.

  A micro-batch's slot on stage s holds its input from the tick it arrives
  (the previous stage's forward; stage 0: its own forward) and then its
  cotangent, until the backward that consumes them.
  """
  M = schedule.num_microbatches
  begin, end = {}, {}
  for t in schedule.tasks:
    if t.kind in ("F", "FB"):
      begin.setdefault((t.stage, t.minibatch, t.microbatch), t.tick)
      if t.stage + 1 < schedule.num_stages:
        begin[(t.stage + 1, t.minibatch, t.microbatch)] = t.tick
    if t.kind in ("B", "FB"):
      micro = (range(M) if schedule.backward_covers_minibatch
               else (t.microbatch,))
      for m in micro:
        end[(t.stage, t.minibatch, m)] = schedule.end_tick(t) - 1
  live = {s: [] for s in range(schedule.num_stages)}
  for (s, p, m), b in begin.items():
    live[s].append((b, end.get((s, p, m), schedule.num_ticks), p * M + m))
  return live


def _num_slots(schedule: Schedule) -> int:
  """The fewest slots C such that micro-batch q uses slot q mod C, no clash."""
  live = _live_intervals(schedule)
  need = 1
  for intervals in live.values():
    points = sorted([(b, 1) for b, _, _ in intervals]
                    + [(e + 1, -1) for _, e, _ in intervals])
    need = max(need, max(np.cumsum([d for _, d in points]), default=1))
  slots = int(need)
  while any(a[2] != b[2] and a[2] % slots == b[2] % slots
            and a[0] <= b[1] and b[0] <= a[1]
            for intervals in live.values()
            for a in intervals for b in intervals):
    slots += 1
  return slots


def _check_gradients_grouped(schedule: Schedule):
  """A stage must finish one minibatch's backwards before starting another's.

  The executor keeps one gradient accumulator per stage.
  """
  for s in range(schedule.num_stages):
    current = None
    for t in schedule.tasks:
      if t.stage != s or t.kind not in ("B", "FB"):
        continue
      if current is not None and t.minibatch != current and (
          schedule.update_ticks[(s, current)] >= t.tick):
        raise ValueError(f"{t} starts before stage {s} applied the update of "
                         f"minibatch {current}; the executor needs each "
                         "stage's backwards grouped by minibatch")
      current = t.minibatch


def _update_reads(schedule: Schedule) -> dict[tuple[int, int], int]:
  """`(stage, update tick) -> version` the update's gradient was computed on.

  Where the micro-batches of a minibatch read different versions (PipeDream
  with M > 1), this is the oldest, that of its first backward.
  """
  return {(s, u): min(schedule.task_version(t) for t in schedule.tasks
                      if t.stage == s and t.minibatch == p
                      and t.kind in ("B", "FB"))
          for (s, p), u in schedule.update_ticks.items()}


def _plan_versions(schedule: Schedule, update_reads: dict) -> tuple[dict, int]:
  """Which stashed version each update overwrites, and the ring size.

  Each stage keeps its weight versions in a ring of R slots. When an update
  makes version a+1, it overwrites the oldest version no later task reads
  (or an empty slot); R is the most versions ever needed at once.

  Returns:
    `(stage, update tick) -> lag of the version overwritten, or -1 (empty)`,
    and R.
  """
  reads = {}  # (stage, version) -> last tick it is read
  for t in schedule.tasks:
    key = (t.stage, schedule.task_version(t))
    reads[key] = max(reads.get(key, -1), t.tick)
  for (s, u), v in update_reads.items():
    reads[(s, v)] = max(reads.get((s, v), -1), u)
  updates = sorted((u, s) for (s, _), u in schedule.update_ticks.items())
  R = 1
  while True:
    ring = {s: {0} for s in range(schedule.num_stages)}
    latest = {s: 0 for s in range(schedule.num_stages)}
    evict, ok = {}, True
    for u, s in updates:
      a = latest[s]
      if len(ring[s]) < R:
        evict[(s, u)] = -1
      else:
        dead = [x for x in ring[s] if reads.get((s, x), -1) <= u]
        if not dead:
          ok = False
          break
        evict[(s, u)] = a - min(dead)
        ring[s].remove(min(dead))
      ring[s].add(a + 1)
      latest[s] = a + 1
    if ok:
      return evict, R
    R += 1


def _window_table(stream: Schedule, starts: list[int], k: int, *,
                  window_minibatches: int, num_ticks: int, num_slots: int,
                  history: int, evict: dict, update_reads: dict) -> np.ndarray:
  """Window k's instruction table `[num_ticks, S, len(FIELDS)]`."""
  B, M, S = window_minibatches, stream.num_microbatches, stream.num_stages
  col = {name: i for i, name in enumerate(FIELDS)}
  table = np.zeros((num_ticks, S, len(FIELDS)), np.int32)
  table[..., col["recv_forward"]] = -1
  table[..., col["recv_backward"]] = -1
  table[..., col["evict"]] = -1
  for t in stream.tasks:
    if not starts[k] <= t.tick < starts[k + 1]:
      continue
    tick = t.tick - starts[k]
    slot = (t.minibatch * M + t.microbatch - k * B * M) % num_slots
    row = table[tick, t.stage]
    row[col["kind"]] = KIND_CODES[t.kind]
    row[col["minibatch"]] = t.minibatch - (k - history) * B
    row[col["microbatch"]] = t.microbatch
    row[col["slot"]] = slot
    row[col["lag"]] = stream.applied(t.stage, t.tick) - stream.task_version(t)
    # Sends happen in the tick a task starts; the receiver files them then.
    if t.kind in ("F", "FB") and t.stage + 1 < S:
      table[tick, t.stage + 1, col["recv_forward"]] = slot
    if t.kind in ("B", "FB") and t.stage > 0:
      table[tick, t.stage - 1, col["recv_backward"]] = slot
  for (s, p), u in stream.update_ticks.items():
    if starts[k] <= u < starts[k + 1]:
      row = table[u - starts[k], s]
      row[col["update"]] = 1
      row[col["update_minibatch"]] = p - (k - history) * B
      row[col["update_lag"]] = stream.applied(s, u) - update_reads[(s, u)]
      row[col["evict"]] = evict[(s, u)]
  return table


def compile_program(schedule: Schedule) -> Program:
  """Turns `schedule` (its window of B minibatches) into instruction tables.

  Args:
    schedule: the schedule of one window; it is rebuilt over a longer stream
      (`Schedule.with_minibatches`) to find the steady state.

  Returns:
    The program.

  Raises:
    ValueError: if the windows do not become periodic, or a stage interleaves
      the backwards of two minibatches.
  """
  B, M = schedule.num_minibatches, schedule.num_microbatches
  K = 4
  while True:
    stream = schedule.with_minibatches((K + 2) * B)
    stream.validate()
    _check_gradients_grouped(stream)
    starts = _window_starts(stream, B, K)
    events = [(t.tick, t.minibatch) for t in stream.tasks] + [
        (u, p) for (_, p), u in stream.update_ticks.items()]
    oldest = min(p - k * B for k in range(K) for tick, p in events
                 if starts[k] <= tick < starts[k + 1])
    update_reads = _update_reads(stream)
    evict, num_versions = _plan_versions(stream, update_reads)
    layout = dict(
        window_minibatches=B,
        num_ticks=max(b - a for a, b in zip(starts, starts[1:])),
        num_slots=_num_slots(stream),
        history=math.ceil(max(0, -oldest) / B), evict=evict,
        update_reads=update_reads)
    tables = [_window_table(stream, starts, k, **layout) for k in range(K)]
    if all(np.array_equal(tables[-1], t) for t in tables[-3:-1]):
      break
    if K >= _MAX_WINDOWS:
      raise ValueError(f"schedule {schedule.name!r} does not reach a periodic "
                       f"steady state within {_MAX_WINDOWS} windows of {B} "
                       "minibatches")
    K *= 2
  first_steady = next(k for k in range(K)
                      if all(np.array_equal(tables[-1], t) for t in tables[k:]))
  return Program(
      tables=np.stack(tables[:first_steady + 1]),
      num_slots=layout["num_slots"], num_versions=num_versions,
      history=layout["history"],
      backward_width=M if stream.backward_covers_minibatch else 1)
