r"""GPipe: synchronous pipeline, all forwards then all backwards, flush.

Run:
  python launch.py --config=configs/gpipe.py --workdir=runs/gpipe
Model/data variants as in configs/default.py, e.g.
`configs/gpipe.py:variant=vgg_digits`.

References:
  Huang et al, GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism <https://arxiv.org/abs/1811.06965>, 2019 (§2.2).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "gpipe"
  return config
