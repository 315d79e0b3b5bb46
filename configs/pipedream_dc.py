r"""PipeDream with SAPipe's full-matrix delay compensation of the stash.

Not SAPipe (that is `configs/sapipe.py`: data parallelism with a 1-step stale
all-reduce): asynchronous PipeDream whose stale gradients are compensated
with SAPipe's full DC for the stash they were computed on.

Run:
  python launch.py --config=configs/pipedream_dc.py --workdir=runs/pipedream_dc
Model/data variants as in configs/default.py, e.g.
`configs/pipedream_dc.py:variant=vgg_digits`.

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
  # Full DC's <g, dx> couples the parameters it spans, and PipeDream applies
  # each minibatch's update on its stages at different ticks, so a whole-model
  # product cannot be taken. SAPipe takes it over one worker's parameters
  # (eq. 1); here each stage is one worker: the product is per stage, said so.
  config.optimizer_scope = "stage"
  return config
