r"""SpecTrain: asynchronous 1F1B without weight stashing, predicted weights.

No stash: every task reads its stage's latest weights, extrapolated over s
updates, `x - lr * s * (mu * b + g)` (the last momentum-SGD step, s times;
`stalepipe.optim.SpecTrain`). s is the paper's pipeline-wide staleness: on
stage k of N, `k // 2 + N - k - 1` for a forward and `k // 2` for a
backward (`Schedule.pipeline_ahead`), defined with one micro-batch per
minibatch, so this config runs M = 1 with the default's examples per
minibatch. `SpecTrain(..., staleness="minibatch")` predicts each task to its
own minibatch's update instead (docs/optim.md compares the two).

Run:
  python launch.py --config=configs/spectrain.py --workdir=runs/spectrain
Model/data variants as in configs/default.py.

References:
  Chen et al, Efficient and Robust Parallel DNN Training through Model
  Parallelism on Multi-GPU Platform (SpecTrain), arXiv 1809.02839, 2018;
  official code github.com/ntueclab/SpecTrain-PyTorch.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "pipedream"
  config.schedule_kwargs = ml_collections.ConfigDict({"weight_stashing": False})
  # The paper's minibatch is one micro-batch; keep the examples per minibatch.
  config.microbatch_size *= config.num_microbatches
  config.num_microbatches = 1
  config.optimizer = "sgd"
  config.optimizer_kwargs = ml_collections.ConfigDict(
      {"learning_rate": 0.05, "momentum": 0.9})
  config.optimizer_wrapper = ("SpecTrain", {"staleness": "pipeline"})
  return config
