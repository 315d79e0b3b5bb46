r"""TiMePReSt: nF1B (N micro-batch forwards, one backward), no stashing.

Run:
  python launch.py --config=configs/timeprest.py --workdir=runs/timeprest
Model/data variants as in configs/default.py, e.g.
`configs/timeprest.py:variant=vgg_digits`.

References:
  TiMePReSt, seed 003 (§4: nF1B, vertical sync, version difference v =
  floor((W+N-2)/N)).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "timeprest"
  return config
