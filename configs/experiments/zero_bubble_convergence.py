r"""Asynchronous zero bubble against zb-h1 and PipeDream: one row per run.

The default MLP on digits, 2 x 4 mesh, M=4, Adam 3e-3, 400 steps. zb-async
applies each gradient one update late; `zb_async_dc` adds SAPipe's full
delay compensation for the stash the gradient used (`stale_params`).
  mkdir -p runs/zero_bubble_convergence
  for r in zb_h1 zb_async zb_async_dc pipedream; do for s in 0 1 2; do
    python launch.py --config=configs/experiments/zero_bubble_convergence.py:row=$r,seed=$s \
        --workdir=runs/zero_bubble_convergence/$r-$s \
        2> runs/zero_bubble_convergence/$r-$s.err; done; done
  python experiments/summarize.py --runs='runs/zero_bubble_convergence/*'
"""

import ml_collections

from configs import common
from configs import pipedream
from configs import zb_async
from configs import zb_h1

_DC = ("delay_compensation",
       {"lam": 0.2, "form": "full", "adaptive": "current", "delay": 0})
ROWS = {"zb_h1": (zb_h1, ()), "zb_async": (zb_async, ()),
        "zb_async_dc": (zb_async, (_DC,)), "pipedream": (pipedream, ())}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, row="zb_async", seed=0)
  if arg.row not in ROWS:
    raise ValueError(f"row {arg.row!r} is invalid; valid: {', '.join(ROWS)}")
  method, transforms = ROWS[arg.row]
  config = method.get_config()
  config.seed = config.dataset_kwargs.seed = arg.seed
  config.update(num_steps=400, num_microbatches=4, transforms=transforms,
                eval_every=0, checkpoint_every=0, plots=False)
  config.optimizer_kwargs.learning_rate = 3e-3
  return config
