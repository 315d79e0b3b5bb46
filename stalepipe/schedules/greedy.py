"""The greedy list scheduler behind every schedule but GPipe's closed form.

Each stage, at each tick, looks at two candidates: its next forward and its
next backward, both taken in (minibatch, micro-batch) order (HetPipe's rules 1
and 2, seed 001 §4, which 1F1B and nF1B follow too). A candidate is *ready*
once its inputs have arrived, the stage holds fewer activations than its cap
(forwards only) and the stage has applied the updates its version needs. When
both are ready, the priority decides: `"backward"` (1F1B, nF1B) or `"fifo"`
(HetPipe rule 3: the one that became ready first, ties to the backward, whose
minibatch is older).

With a split backward (zero bubble, Qi et al, ICLR 2024, §2) the backward
candidate is the input-gradient task "BI", and a third candidate, the next
weight-gradient task "BW" (ready once its own BI has ended), runs only when
neither of the others is ready: it fills bubbles. A micro-batch is held from
its forward to its BW; a second cap bounds the micro-batches whose BI is
still to come (those keep the larger part of the activations, §2.3).

Every stage finishes a minibatch's weight gradients before it starts the next
minibatch's backward, so one gradient accumulator per stage suffices.

A schedule is a `Rules` value: which version each task reads, how many
activations a stage may hold, and the layout (fused F+B on the last stage,
one backward per minibatch, split backward). Decisions at a tick depend only
on the past, so adding minibatches never changes what happens before the new
ones enter: every schedule built here is causal.
"""

from typing import Callable, Mapping, NamedTuple

from stalepipe.schedules import kinds
from stalepipe.schedules.core import Schedule, Task


class View(NamedTuple):
  """What a version rule may look at when a task is considered."""

  applied: tuple[int, ...]  # per stage, updates applied before this tick
  versions: Mapping  # versions of the tasks scheduled so far


class Rules(NamedTuple):
  """What makes one schedule differ from another."""

  version: Callable[[Task, View], int]  # the version the task reads
  priority: str = "backward"  # "backward", "forward" or "fifo"
  cap: Callable[[int], int | None] = lambda stage: None  # activations held
  fused_last: bool = False  # the last stage runs F and B as one FB task
  backward_covers_minibatch: bool = False  # one B per minibatch (nF1B)
  split_backward: bool = False  # BI then BW instead of B (zero bubble)
  # With split_backward: micro-batches whose BI has not ended yet.
  input_cap: Callable[[int], int | None] = lambda stage: None


def _under(count: int, cap: int | None) -> bool:
  return cap is None or count < cap


def build(name: str, num_stages: int, num_microbatches: int,
          num_minibatches: int, rules: Rules) -> Schedule:
  """Runs the list scheduler and returns the schedule it produced."""
  S, M, B = num_stages, num_microbatches, num_minibatches
  forwards = [(p, m) for p in range(B) for m in range(M)]
  backwards = ([(p, 0) for p in range(B)] if rules.backward_covers_minibatch
               else forwards)
  has_backward = [s < S - 1 or not rules.fused_last for s in range(S)]
  backward_kind = "BI" if rules.split_backward else "B"
  next_f, next_b, next_w = [0] * S, [0] * S, [0] * S
  free_at = [0] * S  # first tick the stage is free
  f_end, b_end = {}, {}  # (p, m, s) -> end of its forward / input gradient
  held = [0] * S  # micro-batches held per stage
  pending = [0] * S  # micro-batches whose input gradient is to come
  release = [[] for _ in range(S)]  # (end tick, held, pending) to drop
  left = {(s, p): (1 if rules.backward_covers_minibatch else M)
          for s in range(S) for p in range(B)}
  update_end = [[] for _ in range(S)]  # version k+1 is usable from [k]
  tasks, versions = [], {}
  per_backward = 2 if rules.split_backward else 1
  total = (S * len(forwards)
           + sum(has_backward) * len(backwards) * per_backward)
  tick, idle = 0, 0
  while len(tasks) < total:
    view = View(tuple(sum(e <= tick for e in update_end[s]) for s in range(S)),
                versions)
    progressed = False
    for s in range(S):
      held[s] -= sum(h for e, h, _ in release[s] if e == tick)
      pending[s] -= sum(q for e, _, q in release[s] if e == tick)
      if free_at[s] > tick:
        continue
      cands = []
      if next_f[s] < len(forwards):
        p, m = forwards[next_f[s]]
        kind = "FB" if rules.fused_last and s == S - 1 else "F"
        arrived = f_end.get((p, m, s - 1)) if s > 0 else (
            f_end.get(forwards[next_f[s] - 1] + (s,), 0) if next_f[s] else 0)
        if (arrived is not None and arrived <= tick
            and _under(held[s], rules.cap(s))
            and _under(pending[s], rules.input_cap(s))):
          cands.append((arrived, 1, Task(tick, s, kind, p, m)))
      # The previous minibatch's weight gradients all come first.
      if (has_backward[s] and next_b[s] < len(backwards)
          and len(update_end[s]) >= backwards[next_b[s]][0]):
        p, m = backwards[next_b[s]]
        micro = range(M) if rules.backward_covers_minibatch else (m,)
        deps = [f_end.get((p, mm, s)) for mm in micro]
        if s < S - 1:
          deps.append(b_end.get((p, m, s + 1)))
        if None not in deps and max(deps) <= tick:
          cands.append((max(deps), 0, Task(tick, s, backward_kind, p, m)))
      if rules.split_backward and next_w[s] < next_b[s]:
        p, m = backwards[next_w[s]]
        cands.append((b_end[(p, m, s)], 2, Task(tick, s, "BW", p, m)))
      ready = []
      for arrived, order, task in cands:
        version = rules.version(task, view)
        if version <= view.applied[s]:
          since = update_end[s][version - 1] if version else 0
          ready.append((max(arrived, since), order, task, version))
      if not ready:
        continue
      if rules.priority == "backward":
        ready.sort(key=lambda r: r[1])
      elif rules.priority == "forward":
        ready.sort(key=lambda r: (r[1] != 1, r[1]))
      else:  # a weight gradient only fills what is left
        ready.sort(key=lambda r: (r[1] == 2, r[0], r[1]))
      _, _, task, version = ready[0]
      kind = kinds.kind(task.kind)
      end = tick + kind.duration
      key = (task.minibatch, task.microbatch, s)
      tasks.append(task)
      versions[(task.minibatch, s, task.kind, task.microbatch)] = version
      free_at[s] = end
      progressed = True
      if kind.runs_forward:
        next_f[s] += 1
        f_end[key] = end
        held[s] += 1
        pending[s] += 1
      if kinds.INPUT_COTANGENT in kind.produces:
        if not kind.runs_forward:
          next_b[s] += 1
        b_end[key] = end
        release[s].append(
            (end, 0, M if rules.backward_covers_minibatch else 1))
      if kind.closes_update:
        if kinds.INPUT_COTANGENT not in kind.produces:
          next_w[s] += 1
        release[s].append(
            (end, M if rules.backward_covers_minibatch else 1, 0))
        left[(s, task.minibatch)] -= 1
        if not left[(s, task.minibatch)]:
          update_end[s].append(end)
    idle = 0 if progressed or any(f > tick for f in free_at) else idle + 1
    if idle > 1:
      raise ValueError(f"schedule {name!r} deadlocks at tick {tick} with "
                       f"S={S}, M={M}, B={B}; check its version rule")
    tick += 1
  tasks.sort(key=lambda t: (t.tick, t.stage))
  return Schedule(name, S, M, B, tuple(tasks), versions,
                  backward_covers_minibatch=rules.backward_covers_minibatch)
