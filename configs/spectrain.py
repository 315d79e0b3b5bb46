r"""SpecTrain: asynchronous 1F1B without weight stashing, predicted weights.

No stash: every task reads its stage's latest weights, and each forward and
backward reads them extrapolated over the updates still to come before its
minibatch's own update, `x - lr * s * (mu * b + g)` (the last momentum-SGD
step, s times; `stalepipe.optim.SpecTrain`).

Run:
  python launch.py --config=configs/spectrain.py --workdir=runs/spectrain
Model/data variants as in configs/default.py.

References:
  Chen et al, Efficient and Robust Parallel DNN Training through Model
  Parallelism on Multi-GPU Platform (SpecTrain), arXiv 1809.02839, 2018.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "pipedream"
  config.schedule_kwargs = ml_collections.ConfigDict({"weight_stashing": False})
  config.optimizer = "sgd"
  config.optimizer_kwargs = ml_collections.ConfigDict(
      {"learning_rate": 0.05, "momentum": 0.9})
  config.optimizer_wrapper = ("SpecTrain", {})
  return config
