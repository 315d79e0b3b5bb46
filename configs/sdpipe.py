r"""SDPipe: scheduled group averaging, variance-corrected Adam.

Run:
  python launch.py --config=configs/sdpipe.py --workdir=runs/sdpipe
Model/data variants as in configs/default.py, e.g.
`configs/sdpipe.py:variant=vgg_digits`.

References:
  Miao et al, SDPipe: A Semi-Decentralized Framework for Heterogeneity-aware
  Pipeline-parallel Training, VLDB 2023, seed 002 (§4 group scheduling,
  §4 Adam variance correction).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "1f1b"
  config.sync = "sdpipe"
  config.transforms = (  # num_workers: the trainer's num_replicas
      ("scale_by_variance_reduced_adam", {}),)
  config.optimizer = "sgd"  # here only the learning-rate scaling
  return config
