r"""SAPipe as its paper runs it (seed 004 §3.2, Algorithm 3, §5.1, Table 2).

8 data replicas x 1 stage, a flush schedule; the all-reduced gradient of step
t is applied at step t+1 (it overlaps step t+1's compute), and the forward
reads weights predicted by option 3 with full DC, lam 0.2. SGD, momentum 0.9,
weight decay 5e-5.
  python launch.py --config=configs/sapipe.py --workdir=runs/sapipe
Table 2's rows as `:rule=`: wp3 (default), wp1, wp2, dc (SAPipe-DC),
pipesgd, sync (no staleness), e.g. `configs/sapipe.py:rule=wp1,variant=
vgg_digits` (model/data variants as in configs/default.py).
"""

import ml_collections

from configs import common
from configs import default

_DC = {"lam": 0.2, "form": "full"}
RULES = {"wp3": {"optimizer_wrapper": ("WeightPrediction",
                                       {"option": 3, **_DC})},
         "wp1": {"optimizer_wrapper": ("WeightPrediction", {"option": 1})},
         "wp2": {"optimizer_wrapper": ("WeightPrediction", {"option": 2})},
         "dc": {"transforms": (("stale_gradients", {"delay": 1}),
                               ("delay_compensation", {**_DC, "delay": 1}))},
         "pipesgd": {"transforms": (("stale_gradients", {"delay": 1}),)},
         "sync": {}}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="mlp_digits", rule="wp3")
  config = default.get_config(f"variant={arg.variant}")
  config.update(schedule="gpipe", num_stages=1, num_replicas=8,
                num_microbatches=1, microbatch_size=16, sync="bsp",
                optimizer="sgd", weight_decay=5e-5, weight_decay_mode="l2")
  config.optimizer_kwargs = {"learning_rate": 0.1, "momentum": 0.9}
  common.check_choice("rule", arg.rule, RULES)
  config.update(RULES[arg.rule])
  return config
