r"""Asynchronous zero bubble: ZB-H1 without flushes, one-update-old weights.

Minibatch p reads version max(0, p - 1) on every stage (weight stashing: its
input- and weight-gradient tasks read its forward's version), as
PipeDream-2BW: staleness 1, two versions per stage, no bubble but the fill
and drain once M >= S, at 1F1B's activation memory.

Run:
  python launch.py --config=configs/zb_async.py --workdir=runs/zb_async
Model/data variants as in configs/default.py, e.g.
`configs/zb_async.py:variant=vgg_digits`.

References:
  Qi et al, Zero Bubble (Almost) Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>, 2024 (§2); Narayanan et al,
  Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>, 2021 (§3.1, 2BW).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "zb-async"
  config.remat = "residuals"  # BI keeps op cotangents, BW only weight grads
  return config
