"""Device-level schedules from per-device task orders.

The field writes its interleaved and V schedules (torch.distributed.pipelining's
`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`, `ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`; DeepSeek's `DualPipeV.step`) as an ordered list of
actions per device (rank), with no times. `build` gives them ticks: each
device runs its list in order, a task as soon as the device is free, its
inputs have arrived and its stage has applied the update its version needs,
so the table is the as-soon-as-possible execution of the order on unit (or
given) durations. An action is `(stage, kind, microbatch)`; a *unit* is one
action, or a forward and a backward that run overlapped (DualPipe's F&B):
both start when both are ready and the device is busy until the later ends.

All these schedules are synchronous: every task of minibatch p reads version
p, and minibatch p's order follows minibatch p - 1's on each device, each
task waiting for its stage's update of p - 1 (a flush per stage, as `1f1b`).
"""

from typing import Callable, Mapping, Sequence

from stalepipe.schedules import kinds
from stalepipe.schedules.core import Schedule, Task

Action = tuple[int, str, int]  # (stage, kind, microbatch)
Unit = tuple[Action, ...]  # one action, or an overlapped (forward, backward)


def build(name: str, num_stages: int, num_microbatches: int,
          num_minibatches: int, *, placement: str, num_devices: int,
          order: Callable[[int], Sequence[Unit]],
          durations: Mapping[str, int] | None = None) -> Schedule:
  """Runs each device's `order(device)` (one minibatch) as soon as possible.

  Args:
    name: the schedule's registry name.
    num_stages: S.
    num_microbatches: M.
    num_minibatches: B; each device runs its order B times, minibatch p
      after minibatch p - 1.
    placement: the placement's name (`placement.names()`).
    num_devices: P.
    order: the units device d runs for one minibatch, in order.
    durations: ticks of the kinds that differ from their declared ones.

  Returns:
    The schedule, with its placement and overlapped pairs.
  """
  S, M, B = num_stages, num_microbatches, num_minibatches
  schedule = Schedule(name, S, M, B, (), {}, placement=placement,
                      num_devices=num_devices)
  length = {**schedule.durations, **(durations or {})}
  queues = [[(p, unit) for p in range(B) for unit in order(d)]
            for d in range(num_devices)]
  made = {}  # (minibatch, stage, micro-batch, what) -> end tick
  closes = {}  # (stage, minibatch) -> [weight-gradient tasks, last end]
  tasks, overlapped = [], []
  pos, free_at = [0] * num_devices, [0] * num_devices

  def ready(p, action, tick):
    s, kind, m = action
    k = kinds.kind(kind)
    needs = []
    if k.runs_forward and s > 0:
      needs.append((p, s - 1, m, kinds.OUTPUT))
    if not k.runs_forward:
      needs.append((p, s, m, kinds.OUTPUT))
      if s < S - 1:
        needs.append((p, s + 1, m, kinds.INPUT_COTANGENT))
    if p > 0:  # the stage's update of minibatch p - 1 (version p)
      count, end = closes.get((s, p - 1), (0, None))
      if count < M or end > tick:
        return False
    return all(made.get(n, tick + 1) <= tick for n in needs)

  tick = 0
  while any(pos[d] < len(queues[d]) for d in range(num_devices)):
    progressed = False
    for d in range(num_devices):
      if pos[d] == len(queues[d]) or free_at[d] > tick:
        continue
      p, unit = queues[d][pos[d]]
      if not all(ready(p, a, tick) for a in unit):
        continue
      placed = []
      for s, kind, m in unit:
        task = Task(tick, s, kind, p, m)
        end = tick + length[kind]
        placed.append(task)
        for what in kinds.kind(kind).produces:
          made[(p, s, m, what)] = end
        if kinds.kind(kind).closes_update:
          count, last = closes.get((s, p), (0, 0))
          closes[(s, p)] = (count + 1, max(last, end))
        free_at[d] = max(free_at[d], end)
      tasks.extend(placed)
      if len(placed) == 2:
        overlapped.append(tuple(placed))
      pos[d] += 1
      progressed = True
    if not progressed and max(free_at) <= tick:  # nothing left to wait for
      d = next(d for d in range(num_devices) if pos[d] < len(queues[d]))
      raise ValueError(f"schedule {name!r} deadlocks at tick {tick} with "
                       f"S={S}, M={M}, B={B}: device {d} waits on "
                       f"{queues[d][pos[d]]}")
    tick += 1
  tasks.sort(key=lambda t: (t.tick, t.stage))
  versions = {(t.minibatch, t.stage, t.kind, t.microbatch): t.minibatch
              for t in tasks}
  return Schedule(name, S, M, B, tuple(tasks), versions, length,
                  placement=placement, num_devices=num_devices,
                  overlapped=tuple(overlapped))
