r"""PipeDream-2BW: two weight versions, a constant one-update delay.

Run:
  python launch.py --config=configs/2bw.py --workdir=runs/2bw
Model/data variants as in configs/default.py, e.g.
`configs/2bw.py:variant=vgg_digits`.

References:
  Narayanan et al, Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>, 2021 (§3.1, double-buffered weights).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "2bw"
  return config
