"""Compiling a schedule into per-tick instruction tables for the executor.

The executor is one SPMD program that scans over ticks; at each tick every
stage reads its own row of the tables below and does that task. Everything
here is NumPy and runs once, when a pipeline is built.
"""

from typing import NamedTuple

import numpy as np

from stalepipe.schedules import Schedule

IDLE, FORWARD, BACKWARD, FUSED = 0, 1, 2, 3
KIND_CODES = {"F": FORWARD, "B": BACKWARD, "FB": FUSED}
FIELDS = ("kind", "minibatch", "microbatch", "slot", "recv_forward",
          "recv_backward", "update")


class Program(NamedTuple):
  """Instruction tables, each `[num_ticks, num_stages]` int32."""

  table: np.ndarray  # [T, S, len(FIELDS)]
  num_slots: int  # activation/cotangent buffer slots a stage needs

  def field(self, name: str) -> np.ndarray:
    return self.table[..., FIELDS.index(name)]


def _assign_slots(schedule: Schedule) -> tuple[dict, int]:
  """Buffer slots for every (stage, minibatch, microbatch) in flight.

  A slot on stage s holds the input a forward arrives with (kept for the
  recomputing backward) and then the cotangent that arrives for it; it is taken
  when the input arrives (or at the forward on stage 0) and freed after the
  backward. Slots are assigned greedily, so their number is the largest count
  of micro-batches a stage holds at once.
  """
  S = schedule.num_stages
  taken, freed = {}, {}
  for t in schedule.tasks:
    key = (t.stage, t.minibatch, t.microbatch)
    if t.kind in ("F", "FB"):
      if t.stage == 0:
        taken[key] = t.tick
      if t.stage + 1 < S:
        taken[(t.stage + 1, t.minibatch, t.microbatch)] = (
            schedule.end_tick(t) - 1)
    if t.kind in ("B", "FB"):
      freed[key] = schedule.end_tick(t)
  slots, num_slots = {}, 1
  for s in range(S):
    events = sorted((tick, key) for key, tick in taken.items() if key[0] == s)
    free, busy, used = [], [], 0  # busy: (tick the slot frees, slot)
    for tick, key in events:
      free += [slot for until, slot in busy if until <= tick]
      busy = [(until, slot) for until, slot in busy if until > tick]
      if free:
        slot = min(free)
        free.remove(slot)
      else:
        slot, used = used, used + 1
      slots[key] = slot
      busy.append((freed[key], slot))
    num_slots = max(num_slots, used)
  return slots, num_slots


def compile_program(schedule: Schedule) -> Program:
  """Turns `schedule` into the executor's instruction tables."""
  T, S = schedule.num_ticks, schedule.num_stages
  table = np.zeros((T, S, len(FIELDS)), np.int32)
  table[..., FIELDS.index("recv_forward")] = -1
  table[..., FIELDS.index("recv_backward")] = -1
  slots, num_slots = _assign_slots(schedule)
  col = FIELDS.index
  for t in schedule.tasks:
    row = table[t.tick, t.stage]
    row[col("kind")] = KIND_CODES[t.kind]
    row[col("minibatch")] = t.minibatch
    row[col("microbatch")] = t.microbatch
    row[col("slot")] = slots[(t.stage, t.minibatch, t.microbatch)]
    done = schedule.end_tick(t) - 1
    if t.kind in ("F", "FB") and t.stage + 1 < S:
      table[done, t.stage + 1, col("recv_forward")] = slots[
          (t.stage + 1, t.minibatch, t.microbatch)]
    if t.kind in ("B", "FB") and t.stage > 0:
      table[done, t.stage - 1, col("recv_backward")] = slots[
          (t.stage - 1, t.minibatch, t.microbatch)]
  for (stage, _), tick in schedule.update_ticks.items():
    table[tick, stage, col("update")] = 1
  return Program(table, num_slots)
