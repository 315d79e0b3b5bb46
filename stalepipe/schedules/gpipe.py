"""GPipe: all forwards of a minibatch, then all backwards, then one update.

Each minibatch is flushed before the next starts, so every task of minibatch
`p` reads version `p` on every stage, and the bubble is `(S-1)/(M+S-1)`.

References:
  Huang et al, GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism <https://arxiv.org/abs/1811.06965>, 2019
"""

from stalepipe.schedules.core import Schedule, Task


def gpipe(num_stages: int, num_microbatches: int,
          num_minibatches: int = 1) -> Schedule:
  """Builds the GPipe schedule.

  Micro-batch `m` of minibatch `p` runs forward on stage `s` at tick
  `p*T + s + m` and backward at `p*T + (M+S-1) + (S-1-s) + m`, with
  `T = 2(M+S-1)` ticks per minibatch.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = gpipe(num_stages=4, num_microbatches=4)
    >>> s.num_ticks, round(s.bubble_fraction, 4)
    (14, 0.4286)
  """
  S, M = num_stages, num_microbatches
  period = 2 * (M + S - 1)
  tasks, versions = [], {}
  for p in range(num_minibatches):
    for s in range(S):
      for m in range(M):
        tasks.append(Task(p * period + s + m, s, "F", p, m))
        tasks.append(Task(p * period + (M + S - 1) + (S - 1 - s) + m, s, "B",
                          p, m))
        versions[(p, s, "F", m)] = p
        versions[(p, s, "B", m)] = p
  tasks.sort(key=lambda t: (t.tick, t.stage))
  return Schedule("gpipe", S, M, num_minibatches, tuple(tasks), versions)
