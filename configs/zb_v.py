r"""ZB-V: zero bubble's split backward on the V placement, 2 chunks a device.

Device r holds chunks r and 2P - 1 - r; a micro-batch goes down the devices
and back. With equal F, BI and BW costs a minibatch takes 3vM + P - 1 ticks
and every device holds at most 2P micro-batches (Qi et al. 2024 §6; torch's
`ScheduleZBVZeroBubble` order). Synchronous: it trains what 1F1B trains.

Run:
  python launch.py --config=configs/zb_v.py --workdir=runs/zb_v

References:
  Qi et al, Zero Bubble (Almost) Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>, 2024 (§6, ZB-V).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.update(schedule="zb-v", placement="v", num_stages=8, num_chunks=2,
                remat="residuals")  # BI keeps op cotangents, BW weight grads
  config.model_kwargs.num_hidden_layers = 7  # a block a chunk
  return config
