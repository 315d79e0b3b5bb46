r"""Interleaved 1F1B: 8 chunks on 4 devices (v = 2), the loop placement.

Each device holds chunks d and d + 4 and runs at most one chunk's task a
tick, in the order of torch's `ScheduleInterleaved1F1B`; the bubble is
(P - 1) / (vM) of the ideal, v times 1F1B's. Synchronous: it trains what
1F1B and unpipelined training train.

Run:
  python launch.py --config=configs/interleaved_1f1b.py --workdir=runs/interleaved_1f1b
`--config.num_chunks=4 --config.num_stages=16` holds four chunks a device
(the model needs a block a chunk: `--config.model_kwargs.num_hidden_layers=15`).

References:
  Narayanan et al, Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM <https://arxiv.org/abs/2104.04473>, SC 2021
  (§2.2.2, Figure 4).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.update(schedule="interleaved-1f1b", placement="loop", num_stages=8,
                num_chunks=2)  # 8 / 2 = 4 devices on 'stage', x 2 replicas
  config.model_kwargs.num_hidden_layers = 7  # a block a chunk
  return config
