r"""ZB-H2: zero bubble at about twice 1F1B's activation memory.

More warm-up forwards and the weight-gradient tasks moved to the tail turn
the pipeline into a parallelogram: no bubble between minibatches once
M >= 2S - 1, which this config sets. Each stage updates after its own last weight gradient; there is
no cross-stage check (global-norm clipping would be per stage).

Run:
  python launch.py --config=configs/zb_h2.py --workdir=runs/zb_h2
Model/data variants as in configs/default.py, e.g.
`configs/zb_h2.py:variant=vgg_digits`.

References:
  Qi et al, Zero Bubble (Almost) Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>, 2024 (§2.2, Figure 3 bottom; §4).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "zb-h2"
  config.num_microbatches = 2 * config.num_stages - 1  # zero bubble from here
  config.remat = "residuals"  # BI keeps op cotangents, BW only weight grads
  return config
