r"""PipeSGD: data parallelism with 1-step stale gradients.

Run:
  python launch.py --config=configs/pipesgd.py --workdir=runs/pipesgd
Model/data variants as in configs/default.py, e.g.
`configs/pipesgd.py:variant=vgg_digits`.

References:
  Li et al, Pipe-SGD: A Decentralized Pipelined SGD Framework for Distributed
  Deep Net Training, NeurIPS 2018 (§3); SAPipe, seed 004 (§2.2).
"""

import ml_collections

from configs import bsp


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = bsp.get_config(arg)  # 8 data-parallel replicas, all-reduce
  config.transforms = (("stale_gradients", {"delay": 1}),)
  return config
