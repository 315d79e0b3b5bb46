"""TiMePReSt's nF1B: N forward micro-batches, then one backward per minibatch.

Here a *minibatch* is the unit with one backward: the forwards of its
:math:`N` micro-batches are tasks `F` with `microbatch` :math:`0..N-1`; once
all of them have reached the last stage, one backward per stage, on the mean
loss of the :math:`N` micro-batches, runs as task `B` with `microbatch` 0
(`Schedule.backward_covers_minibatch`). Backward has priority over forward on
every stage (seed 003 §4.2); forwards are injected with no cap.

Versions (seed 003 §4, "vertical sync", no horizontal stashing): a version is
*complete* once a minibatch's backward has finished on every stage. Each
forward micro-batch reads the latest complete version when it enters stage 0,
on every stage; a backward reads the latest complete version when it starts
on the last stage, on every stage, not its forwards' version. The gradient of
minibatch :math:`p` then holds the updates of minibatches :math:`0..p-v`, with
the paper's closed form (eq. 25)

.. math:: v = \\left\\lfloor \\frac{W + N - 2}{N} \\right\\rfloor,
   \\qquad v = 1 \\iff W \\le N + 1.

References:
  Dutta et al, TiMePReSt: Time and Memory Efficient Pipeline Parallel DNN
  Training with Removed Staleness <https://arxiv.org/abs/2410.14312>, 2024
  (§4.2 nF1B, §4.4 version difference, Figures 7, 9, 10)
"""

from stalepipe.schedules import greedy
from stalepipe.schedules.core import Schedule


def timeprest(num_stages: int, num_microbatches: int,
              num_minibatches: int = 1) -> Schedule:
  """Builds TiMePReSt's nF1B schedule.

  Args:
    num_stages: W, pipeline stages (workers).
    num_microbatches: N, forward micro-batches per minibatch.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = timeprest(num_stages=4, num_microbatches=4, num_minibatches=6)
    >>> s.version_difference, s.version(1, 3, "B")
    (1, 1)
  """
  last = num_stages - 1

  def version(task, view):
    if task.kind == "B" and task.stage < last:
      return view.versions[(task.minibatch, last, "B", 0)]
    if task.kind == "F" and task.stage > 0:
      return view.versions[(task.minibatch, 0, "F", task.microbatch)]
    return view.applied[0]

  rules = greedy.Rules(version=version, priority="backward",
                       backward_covers_minibatch=True)
  return greedy.build("timeprest", num_stages, num_microbatches,
                      num_minibatches, rules)
