"""Looped BFS: each device runs all forwards of its chunks, then all backwards.

Lamy-Poirier (Breadth-First Pipeline Parallelism, MLSys 2023) loops the
stages over the devices (stage s on device s mod P) and runs each chunk
breadth first: device d runs every micro-batch's forward on its chunk 0,
then on chunk 1, ..., then the backwards from its last chunk back to chunk
0, micro-batches in reverse order within a chunk: torch's
`ScheduleLoopedBFS._calculate_single_rank_operations`
(`torch/distributed/pipelining/schedules.py`). GPipe's memory (every
micro-batch held on every chunk) with the loop placement's v-fold smaller
fill; with unit F and B per chunk and M >= P a minibatch takes
:math:`2vM + 2(P - 1)` ticks.

References:
  Lamy-Poirier, Breadth-First Pipeline Parallelism
  <https://arxiv.org/abs/2211.05953>, MLSys 2023; torch.distributed.pipelining
  `ScheduleLoopedBFS`.
"""

from stalepipe.schedules import ordered
from stalepipe.schedules.core import Schedule
from stalepipe.schedules.interleaved import device_chunks


def looped_bfs(num_stages: int, num_microbatches: int,
               num_minibatches: int = 1, *, num_devices: int) -> Schedule:
  """Builds looped BFS on `num_devices` devices (v = S / P chunks each).

  Args:
    num_stages: S = v P.
    num_microbatches: M.
    num_minibatches: B, minibatches in the table (a flush between them).
    num_devices: P, devices on the loop placement.

  Returns:
    The device-level schedule.

  Examples:
    >>> s = looped_bfs(num_stages=4, num_microbatches=4, num_devices=2)
    >>> s.num_ticks, s.device_max_in_flight
    (18, (8, 8))
  """
  S, M, P = num_stages, num_microbatches, num_devices
  v = device_chunks("looped-bfs", S, P)

  def order(d):
    chunks = [j * P + d for j in range(v)]
    return ([((s, "F", m),) for s in chunks for m in range(M)]
            + [((s, "B", m),) for s in reversed(chunks)
               for m in reversed(range(M))])

  return ordered.build("looped-bfs", S, M, num_minibatches, placement="loop",
                       num_devices=P, order=order)
