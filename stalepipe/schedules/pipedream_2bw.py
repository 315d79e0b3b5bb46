"""PipeDream-2BW: 1F1B without flushes and double-buffered weights.

Each stage keeps two weight versions. Minibatch :math:`p` (its
:math:`M` micro-batches, gradients accumulated) reads version
:math:`\\max(0, p - 1)` for forward and backward on every stage, so every
update is delayed by exactly one:

.. math:: W^{(t+1)} = W^{(t)} - \\nu \\nabla f(W^{(t-1)}).

With :math:`M \\ge S` (the paper's :math:`m \\ge d`) version :math:`p - 1` is
always there when minibatch :math:`p` enters, and the pipeline never stalls.
:math:`M = S - 1` is accepted too: version
:math:`p - 1` is then applied on stage 0 at the very tick minibatch :math:`p`
needs it, so the version map, the two versions per stage and the
bubble-free steady state (one minibatch every :math:`2M` ticks) hold as for
:math:`M \\ge S`. Smaller :math:`M` is rejected.

References:
  Narayanan et al, Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>, 2021 (§3.1, 2BW weight update semantics)
"""

from stalepipe.schedules import greedy
from stalepipe.schedules.core import Schedule


def pipedream_2bw(num_stages: int, num_microbatches: int,
                  num_minibatches: int = 1) -> Schedule:
  """Builds the PipeDream-2BW schedule.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch, at least S - 1.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = pipedream_2bw(num_stages=4, num_microbatches=4, num_minibatches=6)
    >>> [s.version(p, 0, "F") for p in range(6)], s.stash_depth
    ([0, 0, 1, 2, 3, 4], (2, 2, 2, 2))
  """
  if num_microbatches < num_stages - 1:
    raise ValueError(f"num_microbatches={num_microbatches} is invalid for 2bw "
                     f"with {num_stages} stages; it must be >= num_stages - 1")
  rules = greedy.Rules(version=lambda task, view: max(0, task.minibatch - 1),
                       priority="backward",
                       cap=lambda stage: num_stages - stage)
  return greedy.build("2bw", num_stages, num_microbatches, num_minibatches,
                      rules)
