"""Asynchronous PipeDream: 1F1B without flushes, with weight stashing.

Stage :math:`s` keeps at most :math:`S - s` micro-batches in flight and
alternates forward and backward, backward first. A forward reads the stage's
latest weights and stashes them; its backward reads the same stashed version
(weight stashing, seed 001 §2.2 and §4 "Considering staleness"), so on stage
:math:`s` minibatch :math:`p` misses the updates of the :math:`S - 1 - s`
minibatches still in flight ahead of it (with one micro-batch per minibatch):

.. math:: \\text{version}_s(p) = \\max(0, p - (S - 1 - s)).

With `vertical_sync=True`, every stage reads the version the first stage read
when the micro-batch entered the pipeline, :math:`\\max(0, p - S + 1)`, one
consistent version across stages (PipeDream §3.3, which HetPipe builds on).

With `weight_stashing=False`, a backward reads the stage's latest weights at
its own start instead of its forward's: all updates of the minibatches
before it, version :math:`p`, since a stage runs its backwards in minibatch
order. Forward and backward then see different weights, the setting PipeMare
and SpecTrain start from (and correct for); the schedule's ticks do not
change.

References:
  Narayanan et al, PipeDream: Generalized Pipeline Parallelism for DNN
  Training <https://arxiv.org/abs/1806.03377>, 2019 (§3.3 weight stashing,
  vertical sync); Yang et al, PipeMare: Asynchronous Pipeline Parallel DNN
  Training <https://arxiv.org/abs/1910.05124>, 2021; Chen et al, Efficient
  and Robust Parallel DNN Training through Model Parallelism on Multi-GPU
  Platform (SpecTrain) <https://arxiv.org/abs/1809.02839>, 2018
"""

from stalepipe.schedules import greedy
from stalepipe.schedules.core import Schedule


def pipedream(num_stages: int, num_microbatches: int,
              num_minibatches: int = 1, *,
              vertical_sync: bool = False,
              weight_stashing: bool = True) -> Schedule:
  """Builds the asynchronous PipeDream (1F1B, weight stashing) schedule.

  Micro-batches of one minibatch accumulate into one update per stage, applied
  after the minibatch's last backward on that stage. Forwards may read
  different versions per micro-batch (keys carry the micro-batch); each
  backward reads its own forward's version.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch (PipeDream itself: 1).
    num_minibatches: B, minibatches in the table.
    vertical_sync: read stage 0's version on every stage.
    weight_stashing: a backward reads its forward's version; if False, the
      stage's latest version at its start.

  Returns:
    The schedule.

  Examples:
    >>> s = pipedream(num_stages=4, num_microbatches=1, num_minibatches=8)
    >>> [s.version(7, stage, "F") for stage in range(4)]
    [4, 5, 6, 7]
    >>> s.stash_depth
    (4, 3, 2, 1)
  """

  def version(task, view):
    if task.kind == "B" and not weight_stashing:
      return view.applied[task.stage]
    if task.kind == "B":
      return view.versions[(task.minibatch, task.stage, "F", task.microbatch)]
    if vertical_sync and task.stage > 0:
      return view.versions[(task.minibatch, 0, "F", task.microbatch)]
    return view.applied[task.stage]

  rules = greedy.Rules(version=version, priority="backward",
                       cap=lambda stage: num_stages - stage)
  return greedy.build("pipedream", num_stages, num_microbatches,
                      num_minibatches, rules)
