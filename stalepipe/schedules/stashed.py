r"""PipeDream's rules per chunk on a device-level placement, no flush.

The asynchronous device-level schedules (`pipedream-interleaved`,
`pipedream-v`) place S stages (chunks) on P devices, v = S / P a device, and
run on every device at most one task a tick. Each chunk follows asynchronous
PipeDream (`pipedream.py`): a forward reads its chunk's latest weights and
stashes them, the chunk's backward of that minibatch reads the stashed
version (weight stashing), and the chunk applies the minibatch's update at
the end of that backward. Minibatch p + 1 enters while p is in flight.

Every minibatch does what the previous one did, a period :math:`T` ticks
later: PipeDream's 1F1B carried to chunks. With :math:`T = 2v`, each
device's share of a minibatch, no device idles once the pipeline is full.
A minibatch's 2S tasks sit at fixed offsets from its entry: in the order it
meets them (forwards up the stages, backwards down), each after the last,
on a residue mod :math:`T` that no other task of its device holds, with
the fewest idle ticks in all (`offsets`). So the tasks of different
minibatches never meet on a device (which to run first, PipeDream's
backward-first rule, never arises), and forward :math:`a_s` and backward
:math:`b_s` of stage s give the version map

.. math:: \text{version}_s(p) = \max(0, p - d_s), \quad
          d_s = \lfloor (b_s - a_s) / T \rfloor,

:math:`d_s` the minibatches whose backward on s ends after p's forward
starts there, and :math:`\lceil (b_0 + 1) / T \rceil` minibatches in
flight. Given at most K in flight, fewer, the period grows until they fit:
a bubble of :math:`1 - 2v / T`.
"""

import bisect
import math

from stalepipe.schedules import placement as placement_lib
from stalepipe.schedules.core import Schedule, Task


def offsets(placement: placement_lib.Placement,
            period: int) -> dict[tuple[str, int], int]:
  """`(kind, stage) -> tick` of a minibatch's tasks after its entry.

  The tasks in the order the minibatch meets them, each after the last and
  on a residue mod `period` no other task of its device holds, with the
  fewest idle ticks between them (the shortest round trip); among those,
  the first in the order that delays a task only when it must (a search
  over the delays, each below `period`, by total delay).
  """
  S = placement.num_stages
  device = [placement.where(s)[0] for s in range(S)]
  chain = [("F", s) for s in range(S)] + [("B", s) for s in reversed(range(S))]
  held = set()

  def place(i, tick, budget):
    if i == len(chain):
      return []
    for delay in range(min(budget, period - 1) + 1):
      key = (device[chain[i][1]], (tick + delay) % period)
      if key in held:
        continue
      held.add(key)
      rest = place(i + 1, tick + delay + 1, budget - delay)
      held.discard(key)
      if rest is not None:
        return [tick + delay] + rest
    return None

  budget = 0
  while (found := place(0, 0, budget)) is None:
    budget += 1
  return dict(zip(chain, found))


def in_flight(placement: placement_lib.Placement, period: int) -> int:
  """Minibatches in flight at once with `period`: the round trip / period."""
  return math.ceil((offsets(placement, period)[("B", 0)] + 1) / period)


def build(name: str, num_stages: int, num_microbatches: int,
          num_minibatches: int, *, placement: str, num_devices: int,
          max_in_flight: int | None) -> Schedule:
  """Builds the periodic PipeDream schedule on `placement`.

  Args:
    name: the schedule's registry name.
    num_stages: S.
    num_microbatches: M; must be 1 (PipeDream's setting).
    num_minibatches: B.
    placement: the placement's name (`placement.names()`).
    num_devices: P.
    max_in_flight: K, the most minibatches in flight; None: as many as
      keep every device busy (PipeDream's "NOAM", `in_flight` at T = 2v).

  Returns:
    The device-level schedule.
  """
  S, B, K = num_stages, num_minibatches, max_in_flight
  if num_microbatches != 1:
    raise ValueError(f"num_microbatches={num_microbatches} is invalid for "
                     f"{name}; valid: 1 (a PipeDream minibatch is one "
                     "micro-batch)")
  if K is not None and (not isinstance(K, int) or K < 1):
    raise ValueError(f"max_in_flight={K!r} is invalid for {name}; it must be "
                     "an integer >= 1, or None")
  placed = placement_lib.make(placement, S, num_devices)
  period = 2 * (S // num_devices)
  while K is not None and in_flight(placed, period) > K:
    period += 1
  at = offsets(placed, period)
  tasks = sorted((Task(p * period + at[(k, s)], s, k, p, 0)
                  for p in range(B) for k, s in at),
                 key=lambda t: (t.tick, t.stage))
  versions = {}
  for s in range(S):  # a forward reads the updates ended before it starts
    updates = [t.tick + 1 for t in tasks if (t.stage, t.kind) == (s, "B")]
    for t in tasks:
      if (t.stage, t.kind) == (s, "F"):
        versions[(t.minibatch, s, "F", 0)] = bisect.bisect_right(updates,
                                                                 t.tick)
        versions[(t.minibatch, s, "B", 0)] = versions[(t.minibatch, s, "F",
                                                       0)]
  return Schedule(name, S, 1, B, tuple(tasks), versions,
                  placement=placement, num_devices=num_devices)
