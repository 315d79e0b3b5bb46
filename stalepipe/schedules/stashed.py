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
A minibatch's 2S tasks sit at fixed offsets from its entry, forwards up the
stages and backwards down, each the tick after the last but for `wrap`
ticks at each return from the last device to the first (the loop's rounds)
and `turn` ticks between the last stage's forward and its backward: the
fewest that put a device's 2v tasks on distinct residues mod :math:`T`
(`offsets`). So the tasks of different minibatches never meet on a device
(which to run first, PipeDream's backward-first rule, never arises), and
forward :math:`a_s` and backward :math:`b_s` of stage s give the version
map

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
            period: int) -> dict[tuple[str, int], int] | None:
  """`(kind, stage) -> tick` of a minibatch's tasks after its entry.

  Forwards up the stages and backwards down, each task the tick after the
  last but for two waits: `wrap` ticks each time the minibatch passes from
  the last device to the first (the loop's rounds, both ways; a V has
  none), and `turn` ticks between the last stage's forward and backward.
  Of the (wrap, turn) below `period` whose tasks hold distinct residues mod
  `period` on every device, the fewest idle ticks in all, then the smallest
  wrap; None where none does.
  """
  S, P = placement.num_stages, placement.num_devices
  device = [placement.where(s)[0] for s in range(S)]
  laps = [sum(P > 1 and (device[k - 1], device[k]) == (P - 1, 0)
              for k in range(1, s + 1)) for s in range(S)]

  def tasks(wrap, turn):
    forward = {("F", s): s + wrap * laps[s] for s in range(S)}
    last = forward[("F", S - 1)] + 1 + turn
    return {**forward, **{("B", s): last + (S - 1 - s)
                          + wrap * (laps[S - 1] - laps[s])
                          for s in reversed(range(S))}}

  def fits(at):
    held = {(device[s], tick % period) for (_, s), tick in at.items()}
    return len(held) == 2 * S

  return min((tasks(w, t) for w in range(period) for t in range(period)
              if fits(tasks(w, t))),
             key=lambda at: (at[("B", 0)], at[("F", S - 1)]), default=None)


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
      keep every device busy (PipeDream's "NOAM"), those of T = 2v.

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
  period = 2 * (S // num_devices)  # T = 2v always fits
  while (at := offsets(placed, period)) is None or (
      K is not None and math.ceil((at[("B", 0)] + 1) / period) > K):
    period += 1  # some period at most the round trip fits K
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
