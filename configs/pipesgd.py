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

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.num_stages = 1
  config.num_replicas = 8
  config.num_microbatches = 1
  config.microbatch_size = 8
  config.transforms = (("stale_gradients", {"delay": 1}),)
  return config
