r"""1F1B (PipeDream-Flush): one forward, one backward; flush per minibatch.

Run:
  python launch.py --config=configs/1f1b.py --workdir=runs/1f1b
Model/data variants as in configs/default.py, e.g.
`configs/1f1b.py:variant=vgg_digits`.

References:
  Narayanan et al, Memory-Efficient Pipeline-Parallel DNN Training
  <https://arxiv.org/abs/2006.09503>, 2021 (§3.1, PipeDream-Flush).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "1f1b"
  return config
