"""Compiling a schedule into per-tick instruction tables for the executor.

The executor is one SPMD program that scans over the ticks of a *window* (the
schedule's B minibatches); at each tick every stage reads its own row of the
tables and does that task. Asynchronous schedules keep work in flight across
windows, so a window is cut from the schedule of an endless stream of
minibatches: window k holds every task from the stage-0 forward of minibatch
kB up to, not including, that of minibatch (k+1)B. Everything a table names is
relative (minibatch within the window's input history, weight version as a lag
behind the stage's latest, buffer slot as an offset from the window's first),
so after a warm-up every window's table is the same and one compiled program
runs them all. Tasks are coded by kind (`stalepipe.schedules.kinds`): the
program lists the kinds the schedule uses and the executor builds one branch
per kind from what the kind declares.
Everything here is NumPy and runs once, when a pipeline is built.
"""

import math
from typing import NamedTuple

import numpy as np

from stalepipe.schedules import Schedule
from stalepipe.schedules import kinds as kinds_lib

IDLE = 0  # kind code of an idle slot; kind i of `Program.kinds` is i + 1
_MAX_WINDOWS = 64


class Instructions(NamedTuple):
  """Instruction tables as named columns, each int32 `[..., T, S]`.

  Row `[tick, stage]` of every column describes what that stage does in that
  tick of a window.
  """

  kind: np.ndarray  # IDLE, or 1 + the task kind's index in Program.kinds
  minibatch: np.ndarray  # index into the window's input history, [0, (H+1)B)
  microbatch: np.ndarray
  slot: np.ndarray  # buffer slot of the task's (first) micro-batch, less
  #   k*B*M mod C
  lag: np.ndarray  # the version read is `latest - lag`
  ahead: np.ndarray  # `Schedule.ahead`: updates until its minibatch's update
  since_forward: np.ndarray  # `Schedule.since_forward`
  pipeline_ahead: np.ndarray  # `Schedule.pipeline_ahead`; 0 where undefined
  recv_forward: np.ndarray  # slot for the activation arriving this tick; -1
  recv_backward: np.ndarray  # slot for the cotangents arriving this tick; -1
  update: np.ndarray  # 1: apply the minibatch's update at the end of the tick
  update_minibatch: np.ndarray  # the updated minibatch, as `minibatch`
  update_lag: np.ndarray  # the version its gradient was computed on, as a lag
  update_staleness: np.ndarray  # updates since its forward read (tau)
  evict: np.ndarray  # the version the update overwrites, as a lag; -1: empty
  #   (a pooled stash: the lag behind this stage's latest of the version of
  #   local slot `evict_slot` it overwrites, `pool.py`)
  evict_slot: np.ndarray  # a pooled stash: the local slot whose version the
  #   update overwrites; -1: an empty row (and always -1 without a pool)


# Columns whose blank is -1 (the others' is 0).
BLANK_MINUS_ONE = ("recv_forward", "recv_backward", "evict", "evict_slot")


def blank(name: str) -> int:
  """Column `name`'s value where a stage does nothing (`BLANK_MINUS_ONE`)."""
  return -1 if name in BLANK_MINUS_ONE else 0


class Program(NamedTuple):
  """A schedule compiled for the executor."""

  tables: Instructions  # columns [K, T, S]; window k >= K-1 uses [-1]
  kinds: tuple[str, ...]  # the task kinds the schedule uses, in code order
  num_slots: int  # C: activation/cotangent buffer slots per stage
  ring_sizes: tuple[int, ...]  # per stage, the weight versions its stash
  #   ring holds (R_s; `evict` is planned for it)
  history: int  # H: earlier windows whose inputs tasks still read
  backward_width: int  # micro-batches one backward covers (M for nF1B)
  pool_size: int = 0  # rows of a device's pooled stash (`pool.py`; the most
  #   versions its stages hold at once, the most over the devices); 0: the
  #   stash is held in one ring a slot (`ring_sizes`)

  @property
  def num_versions(self) -> int:
    """R: the most versions any stage's ring holds."""
    return max(self.ring_sizes)

  def kind_code(self, name: str) -> int:
    """The code of task kind `name` in the tables."""
    return 1 + self.kinds.index(name)


def _window_starts(schedule: Schedule, B: int, K: int) -> list[int]:
  """First tick of windows 0..K: the stage-0 forward of minibatch kB."""
  first = {t.minibatch: t.tick for t in schedule.tasks
           if t.stage == 0 and schedule.kind(t).runs_forward
           and t.microbatch == 0}
  return [first[k * B] for k in range(K + 1)]


def _live_intervals(schedule: Schedule) -> dict[int, list]:
  """Per stage, (first tick, last tick, global micro-batch) a slot is held.

  A micro-batch's slot on stage s holds its input from the tick it arrives
  (the previous stage's forward; stage 0: its own forward) and then its
  cotangent, until the last task there that covers it ends.
  """
  M = schedule.num_microbatches
  begin = {}
  for t in schedule.tasks:
    if schedule.kind(t).runs_forward:
      begin.setdefault((t.stage, t.minibatch, t.microbatch), t.tick)
      if t.stage + 1 < schedule.num_stages:
        begin[(t.stage + 1, t.minibatch, t.microbatch)] = t.tick
  live = {s: [] for s in range(schedule.num_stages)}
  for (s, p, m), b in begin.items():
    _, end = schedule.held.get((s, p, m), (b, schedule.num_ticks + 1))
    live[s].append((b, end - 1, p * M + m))
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
      if t.stage != s or not schedule.kind(t).closes_update:
        continue
      if current is not None and t.minibatch != current and (
          schedule.update_ticks[(s, current)] >= t.tick):
        raise ValueError(f"{t} starts before stage {s} applied the update of "
                         f"minibatch {current}; the executor needs each "
                         "stage's backwards grouped by minibatch")
      current = t.minibatch


def _ring_evictions(updates: list[int], reads: dict[int, int], size: int
                    ) -> dict[int, int] | None:
  """One stage's ring of `size` slots over its updates (their ticks, in
  order): at each, the lag of the version it overwrites (the oldest no later
  task reads) or -1 for an empty slot; None if some update finds no slot."""
  ring, latest, evict = {0}, 0, {}
  for u in updates:
    if len(ring) < size:
      evict[u] = -1
    else:
      dead = [x for x in ring if reads.get(x, -1) <= u]
      if not dead:
        return None
      evict[u] = latest - min(dead)
      ring.remove(min(dead))
    latest += 1
    ring.add(latest)
  return evict


def _stage_reads(schedule: Schedule) -> tuple[list[dict], list[dict]]:
  """Per stage, `{version: last tick it is read}` by tasks, and by updates
  (their `stale_params`)."""
  S = schedule.num_stages
  tasks, updates = [{} for _ in range(S)], [{} for _ in range(S)]
  for t in schedule.tasks:
    v = schedule.task_version(t)
    tasks[t.stage][v] = max(tasks[t.stage].get(v, -1), t.tick)
  for (s, p), u in schedule.update_ticks.items():
    v = schedule.gradient_version(s, p)
    updates[s][v] = max(updates[s].get(v, -1), u)
  return tasks, updates


def _plan_versions(schedule: Schedule, ring_groups=None
                   ) -> tuple[dict, tuple[int, ...]]:
  """Which stashed version each update overwrites, and each stage's ring size.

  Each stage keeps its weight versions in a ring. When an update makes
  version a+1, it overwrites the oldest version no later task reads (or an
  empty slot). A stage's ring holds the most versions it ever needs at once,
  or, for the stages of one of `ring_groups` (held as one array, so of one
  size: the stages in one slot of a placement), the most any of them needs.

  Returns:
    `(stage, update tick) -> lag of the version overwritten, or -1 (empty)`,
    and the ring size of each stage.
  """
  S = schedule.num_stages
  task_reads, update_reads = _stage_reads(schedule)
  reads = [{v: max(a.get(v, -1), b.get(v, -1)) for v in {*a, *b}}
           for a, b in zip(task_reads, update_reads)]
  updates = [sorted(u for (t, _), u in schedule.update_ticks.items() if t == s)
             for s in range(S)]
  needed = []
  for s in range(S):
    size = 1
    while _ring_evictions(updates[s], reads[s], size) is None:
      size += 1
    needed.append(size)
  sizes = list(needed)
  for group in () if ring_groups is None else ring_groups:
    for s in group:
      sizes[s] = max(needed[t] for t in group)
  evict = {(s, u): lag for s in range(S)
           for u, lag in _ring_evictions(updates[s], reads[s],
                                         sizes[s]).items()}
  return evict, tuple(sizes)


def pool_evictions(updates: list[tuple[int, int]], reads: list[dict],
                   update_reads: list[dict], size: int, live=None,
                   latest=None) -> dict | None:
  """One device's pooled stash of `size` rows over its slots' updates
  (`(tick, slot)` in the order the tick applies them): at each, `(slot,
  lag)` of the version it overwrites, the lag behind the updating stage's
  latest (`(-1, -1)`: an empty row); None if some update finds no row.

  A version is dead once no later task reads it (`reads`, as in
  `_ring_evictions`) and, for another slot's version, no update of that
  slot still to come reads it (`update_reads`: its `stale_params`) and it
  is not that slot's latest (the weights its next update steps from). A
  drain leaves updates out, so it plans its own rows (`pool.replan`).
  The update takes the oldest dead version of its own slot, else the
  oldest of the lowest other slot.
  """
  F = len(reads)
  live = {(j, 0) for j in range(F)} if live is None else set(live)
  latest = [0] * F if latest is None else list(latest)
  evict = {}
  for u, j in updates:
    if len(live) < size:
      evict[(u, j)] = (-1, -1)
    else:
      def dead(o, v, u=u, j=j):
        if o == j:
          return max(reads[o].get(v, -1), update_reads[o].get(v, -1)) <= u
        last = update_reads[o].get(v, -1)
        return (v != latest[o] and reads[o].get(v, -1) <= u
                and (last < u or (last == u and o < j)))
      dead_rows = sorted((o != j, o, v) for o, v in live if dead(o, v))
      if not dead_rows:
        return None
      _, o, v = dead_rows[0]
      evict[(u, j)] = (o, latest[j] - v)
      live.remove((o, v))
    latest[j] += 1
    live.add((j, latest[j]))
  return evict


def _plan_pool(schedule: Schedule, devices) -> tuple[dict, int]:
  """Which version each update overwrites in a stash pooled per device
  (`devices`: the stages of each device, in local slot order), and the
  pool's size: the fewest rows with which every device's updates find one.

  Returns:
    `(stage, update tick) -> (local slot, lag)` (`pool_evictions`), and the
    pool's rows.
  """
  reads, update_reads = _stage_reads(schedule)
  plans, size = [], max(len(stages) for stages in devices)
  for stages in devices:
    slot = {int(s): j for j, s in enumerate(stages)}
    updates = sorted((u, slot[s]) for (s, _), u in
                     schedule.update_ticks.items() if s in slot)
    args = ([reads[int(s)] for s in stages],
            [update_reads[int(s)] for s in stages])
    while pool_evictions(updates, *args, size) is None:
      size += 1
    plans.append((stages, updates, args))
  evict = {}
  for stages, updates, args in plans:  # every device plans for the one size
    for (u, j), row in pool_evictions(updates, *args, size).items():
      evict[(int(stages[j]), u)] = row
  return evict, size


def _window_table(stream: Schedule, starts: list[int], k: int, *,
                  kinds: tuple[str, ...], window_minibatches: int,
                  num_ticks: int, num_slots: int, history: int,
                  evict: dict) -> Instructions:
  """Window k's instructions, columns `[num_ticks, S]`."""
  B, M, S = window_minibatches, stream.num_microbatches, stream.num_stages
  table = {name: np.full((num_ticks, S), blank(name), np.int32)
           for name in Instructions._fields}
  for t in stream.tasks:
    if not starts[k] <= t.tick < starts[k + 1]:
      continue
    tick, s, kind = t.tick - starts[k], t.stage, stream.kind(t)
    slot = (t.minibatch * M + t.microbatch - k * B * M) % num_slots
    row = {"kind": 1 + kinds.index(t.kind),
           "minibatch": t.minibatch - (k - history) * B,
           "microbatch": t.microbatch, "slot": slot,
           "lag": stream.applied(s, t.tick) - stream.task_version(t),
           "ahead": stream.ahead(t), "since_forward": stream.since_forward(t),
           "pipeline_ahead": (0 if stream.pipeline_ahead_error
                              else stream.pipeline_ahead(t))}
    for name, value in row.items():
      table[name][tick, s] = value
    # Sends happen in the tick a task starts; the receiver files them then.
    if kind.runs_forward and s + 1 < S:
      table["recv_forward"][tick, s + 1] = slot
    if kinds_lib.INPUT_COTANGENT in kind.produces and s > 0:
      table["recv_backward"][tick, s - 1] = slot
  for (s, p), u in stream.update_ticks.items():
    if starts[k] <= u < starts[k + 1]:
      applied = stream.applied(s, u)
      evict_slot, lag = (evict[(s, u)] if isinstance(evict[(s, u)], tuple)
                         else (-1, evict[(s, u)]))
      row = {"update": 1, "update_minibatch": p - (k - history) * B,
             "update_lag": applied - stream.gradient_version(s, p),
             "update_staleness": applied - stream.forward_version(s, p),
             "evict": lag, "evict_slot": evict_slot}
      for name, value in row.items():
        table[name][u - starts[k], s] = value
  return Instructions(**table)


def compile_program(schedule: Schedule, ring_groups=None,
                    pools=None) -> Program:
  """Turns `schedule` (its window of B minibatches) into instruction tables.

  Args:
    schedule: the schedule of one window; it is rebuilt over a longer stream
      (`Schedule.with_minibatches`) to find the steady state.
    ring_groups: sets of stages whose rings are one array (the stages in one
      slot of a placement, `placement.py`), so of one size; default: each
      stage's ring holds the versions it needs.
    pools: the stages of each device, in local slot order, whose versions
      share one pooled stash (`pool.py`; `Program.pool_size` rows, and each
      update's row planned by `_plan_pool`); default: a ring a stage.

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
    evict, ring_sizes = _plan_versions(stream, ring_groups)
    if pools is not None:
      evict, pool_size = _plan_pool(stream, pools)
    kinds = tuple(k for k in kinds_lib.KINDS
                  if any(t.kind == k for t in stream.tasks))
    layout = dict(
        kinds=kinds, window_minibatches=B,
        num_ticks=max(b - a for a, b in zip(starts, starts[1:])),
        num_slots=_num_slots(stream),
        history=math.ceil(max(0, -oldest) / B), evict=evict)
    tables = [_window_table(stream, starts, k, **layout) for k in range(K)]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))  # pylint: disable=unnecessary-lambda-assignment
    if all(same(tables[-1], t) for t in tables[-3:-1]):
      break
    if K >= _MAX_WINDOWS:
      raise ValueError(f"schedule {schedule.name!r} does not reach a periodic "
                       f"steady state within {_MAX_WINDOWS} windows of {B} "
                       "minibatches")
    K *= 2
  first_steady = next(k for k in range(K)
                      if all(same(tables[-1], t) for t in tables[k:]))
  kept = tables[:first_steady + 1]
  return Program(
      tables=Instructions(*[np.stack(column) for column in zip(*kept)]),
      kinds=kinds, num_slots=layout["num_slots"], ring_sizes=ring_sizes,
      history=layout["history"],
      backward_width=M if stream.backward_covers_minibatch else 1,
      pool_size=0 if pools is None else pool_size)


def drain_table(program: Program, window: int, first_new: int) -> Instructions:
  """Window `window`'s table with only the work of earlier minibatches: every
  task and update of a minibatch at index `first_new` or later of the
  window's input history made idle, and nothing arriving from such a task.
  Columns `[1, T, S]`, as the executor takes them (`Pipeline.drain`)."""
  K = program.tables.kind.shape[0]
  t = Instructions(*[np.array(c[min(window, K - 1)]) for c in program.tables])
  new = (t.kind != IDLE) & (t.minibatch >= first_new)
  recv_forward, recv_backward = t.recv_forward.copy(), t.recv_backward.copy()
  recv_forward[:, 1:][new[:, :-1]] = -1
  recv_backward[:, :-1][new[:, 1:]] = -1
  late = (t.update == 1) & (t.update_minibatch >= first_new)
  table = t._replace(kind=np.where(new, IDLE, t.kind).astype(np.int32),
                     recv_forward=recv_forward, recv_backward=recv_backward,
                     update=np.where(late, 0, t.update).astype(np.int32))
  return Instructions(*[c[None] for c in table])
