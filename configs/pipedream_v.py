r"""Asynchronous PipeDream on the V placement, 2 chunks a device.

Device r holds chunks r and 2P - 1 - r; each chunk follows PipeDream's rules
(weight stashing, its update after its own backward, no flush), one task a
device a tick and a minibatch of one micro-batch entering every 4 ticks.
Chunk s of minibatch p reads version max(0, p - d_s), d_s = P - ceil(s/2)
for P even (P - 1 - floor(s/2) for P odd), and every device keeps P + 2
weight versions (`stalepipe/schedules/pipedream_v.py`), which the pooled
stash holds (`stash="pooled"`, `stalepipe/pipeline/pool.py`: 6 a device at
P = 4, where one ring a slot holds 8).

Run:
  python launch.py --config=configs/pipedream_v.py --workdir=runs/pipedream_v

References:
  Narayanan et al, PipeDream: Generalized Pipeline Parallelism for DNN
  Training, SOSP 2019 (§3.3, weight stashing); Qi et al, Pipeline
  Parallelism with Controllable Memory <https://arxiv.org/abs/2405.15362>,
  2024 (the V placement).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.update(schedule="pipedream-v", placement="v", num_stages=8,
                num_chunks=2, num_microbatches=1,  # PipeDream's minibatch
                microbatch_size=32, stash="pooled")
  config.model_kwargs.num_hidden_layers = 7  # a block a chunk
  return config
