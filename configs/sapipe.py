r"""SAPipe: asynchronous pipeline with SAPipe's full-matrix delay compensation.

Run:
  python launch.py --config=configs/sapipe.py --workdir=runs/sapipe
Model/data variants as in configs/default.py, e.g.
`configs/sapipe.py:variant=vgg_digits`.

References:
  SAPipe, seed 004 (§3.2 eq. 1: full-matrix delay compensation, adaptive
  lambda); the gradient is compensated for the stash it was computed on.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "pipedream"
  config.transforms = (
      # delay=0: the executor passes the stash each gradient was computed on
      # as stale_params, so the transform keeps no history of its own.
      ("delay_compensation", {"lam": 0.2, "form": "full",
                              "adaptive": "current", "delay": 0}),)
  return config
