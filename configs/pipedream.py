r"""PipeDream: asynchronous 1F1B with weight stashing, no flush.

Run:
  python launch.py --config=configs/pipedream.py --workdir=runs/pipedream
Model/data variants as in configs/default.py, e.g.
`configs/pipedream.py:variant=vgg_digits`.

References:
  Narayanan et al, PipeDream: Generalized Pipeline Parallelism for DNN Training,
  SOSP 2019 (§3.3, weight stashing).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "pipedream"
  return config
