"""HetPipe: pipelined model parallelism inside one virtual worker (seed 001 §4).

Up to :math:`N_m` minibatches are in the pipeline at once. Each GPU schedules
its tasks by the partition scheduling rules of seed 001 §4: (1) the forward of
minibatch :math:`p` after the forwards of every :math:`p' < p`; (2) likewise
for backwards; (3) FIFO among forward and backward tasks. The last stage runs
a minibatch's forward immediately followed by its backward as one task (FB).

Minibatch :math:`p` reads :math:`w_{local}` holding exactly the updates of
minibatches :math:`0..p - N_m` (none for :math:`p < N_m`), one consistent
version across stages, so its local staleness is
:math:`s_{local} = N_m - 1` and, for SGD,

.. math:: x_p = x_{p-1} - \\eta \\nabla f(x_{p - N_m}).

References:
  Park et al, HetPipe: Enabling Large DNN Training on (Whimpy) Heterogeneous
  GPU Clusters through Integration of Pipelined Model Parallelism and Data
  Parallelism <https://arxiv.org/abs/2005.14038>, 2020 (§4, Figure 1)
"""

from stalepipe.schedules import greedy
from stalepipe.schedules import kinds
from stalepipe.schedules.core import Schedule


def hetpipe(num_stages: int, num_microbatches: int, num_minibatches: int = 1,
            *, concurrent_minibatches: int = 1) -> Schedule:
  """Builds HetPipe's schedule of one virtual worker.

  Args:
    num_stages: S, GPUs (partitions) of the virtual worker.
    num_microbatches: M, micro-batches per minibatch (HetPipe itself: 1).
    num_minibatches: B, minibatches in the table.
    concurrent_minibatches: N_m, minibatches in the pipeline at once.

  Returns:
    The schedule.

  Examples:
    >>> s = hetpipe(num_stages=4, num_microbatches=1, num_minibatches=8,
    ...             concurrent_minibatches=4)
    >>> [s.version(p, 0, "F") for p in range(8)], s.staleness[7]
    ([0, 0, 0, 0, 1, 2, 3, 4], 3)
  """
  n_m = concurrent_minibatches
  if not isinstance(n_m, int) or n_m < 1:
    raise ValueError(f"concurrent_minibatches={n_m!r} is invalid; it must be "
                     "an integer >= 1")
  rules = greedy.Rules(
      version=lambda task, view: max(0, task.minibatch - n_m + 1),
      priority="fifo", fused_last=True)
  return greedy.build("hetpipe", num_stages, num_microbatches,
                      num_minibatches, rules)


def measured_global_staleness(schedule: Schedule, clock_distance: int) -> int:
  r"""WSP's global staleness :math:`s_{global}`, measured on a HetPipe schedule.

  Waves are runs of :math:`s_{local} + 1` minibatches, :math:`s_{local}` the
  schedule's measured local staleness. A virtual worker's local clock is the
  number of its waves whose updates are all applied; when minibatch :math:`p`
  enters the pipeline at local clock :math:`c`, WSP only guarantees the
  global updates of waves :math:`0..c - D - 1` (seed 001 §5). The result is
  the most minibatches before :math:`p` whose updates that leaves out; WSP's
  closed form is `stalepipe.theory.wsp_global_staleness`.

  Args:
    schedule: a `hetpipe` schedule with at least two waves.
    clock_distance: D, the clock distance allowed between virtual workers.

  Returns:
    The measured :math:`s_{global}`.

  Examples:
    >>> s = hetpipe(4, 1, num_minibatches=16, concurrent_minibatches=4)
    >>> measured_global_staleness(s, clock_distance=0)
    6
  """
  if not isinstance(clock_distance, int) or clock_distance < 0:
    raise ValueError(f"clock_distance={clock_distance!r} is invalid; it must "
                     "be an integer >= 0")
  wave = max(schedule.staleness) + 1
  done = [max(u for (_, p), u in schedule.update_ticks.items() if p == q)
          for q in range(schedule.num_minibatches)]
  wave_done = [max(done[w * wave:(w + 1) * wave])
               for w in range(schedule.num_minibatches // wave)]
  worst = 0
  for t in schedule.tasks:
    if t.stage == 0 and t.microbatch == 0 and kinds.kind(t.kind).runs_forward:
      clock = sum(u < t.tick for u in wave_done)
      covered = max(0, clock - clock_distance) * wave
      worst = max(worst, t.minibatch - covered)
  return worst
