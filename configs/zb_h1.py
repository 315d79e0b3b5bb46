r"""ZB-H1: zero bubble's split backward at 1F1B's activation memory.

The backward splits into an input-gradient task (BI), which the previous
stage waits for, and a weight-gradient task (BW) that fills bubbles; a flush
per minibatch keeps it synchronous. With equal F/BI/BW costs the bubble is a
third of 1F1B's.

Run:
  python launch.py --config=configs/zb_h1.py --workdir=runs/zb_h1
Model/data variants as in configs/default.py, e.g.
`configs/zb_h1.py:variant=vgg_digits`.

References:
  Qi et al, Zero Bubble (Almost) Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>, 2024 (§2.1, Figure 3 top).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "zb-h1"
  config.remat = "residuals"  # BI keeps op cotangents, BW only weight grads
  return config
