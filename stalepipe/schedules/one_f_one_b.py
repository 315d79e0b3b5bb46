"""1F1B with a flush per minibatch (PipeDream-Flush, the DAPPLE/Megatron schedule).

Stage :math:`s` runs at most :math:`S - s` forwards ahead of its backwards,
then alternates one forward and one backward, backward first. Every
micro-batch of minibatch :math:`p` reads version :math:`p` on every stage, so
the next minibatch waits for the flush, and the bubble is GPipe's,

.. math:: \\frac{S - 1}{M + S - 1},

with fewer activations held: stage :math:`s` holds at most
:math:`\\min(S - s, M)` micro-batches instead of :math:`M`.

References:
  Narayanan et al, Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>, 2021 (PipeDream-Flush, §2.3)
"""

from stalepipe.schedules import greedy
from stalepipe.schedules.core import Schedule


def one_f_one_b(num_stages: int, num_microbatches: int,
                num_minibatches: int = 1) -> Schedule:
  """Builds the 1F1B (PipeDream-Flush) schedule.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = one_f_one_b(num_stages=4, num_microbatches=8)
    >>> s.num_ticks, s.max_in_flight
    (22, (4, 3, 2, 1))
  """
  rules = greedy.Rules(version=lambda task, view: task.minibatch,
                       priority="backward",
                       cap=lambda stage: num_stages - stage)
  return greedy.build("1f1b", num_stages, num_microbatches, num_minibatches,
                      rules)
