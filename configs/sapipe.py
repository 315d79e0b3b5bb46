r"""SAPipe as its paper runs it: data parallel, the all-reduce 1 step stale.

Each of the 8 data replicas (one stage each, a flush schedule) computes its
gradient; the all-reduced gradient of step t is applied at step t+1, so the
all-reduce overlaps step t+1's compute, and the forward reads the weights
SAPipe's weight prediction expects (option 3 with full delay compensation,
lam = 0.2, its default; seed 004 §3.2, Algorithm 3, §5.1). SGD with 0.9
momentum and 5e-5 weight decay, as §5.1 trains its CV models.

Run:
  python launch.py --config=configs/sapipe.py --workdir=runs/sapipe
Update-rule variants (`:rule=NAME`, SAPipe Table 2's rows): wp3 (default),
wp1, wp2 (weight prediction options), dc (SAPipe-DC: the stale gradient
with full delay compensation, no prediction), pipesgd (1-step stale, no
compensation), sync (no staleness: BytePS/Horovod's row), e.g.
  python launch.py --config=configs/sapipe.py:rule=pipesgd --workdir=runs/p
Model/data variants as in configs/default.py (`:variant=vgg_digits,rule=wp1`).

References:
  Chen et al, SAPipe (seed 004) §3.2, Algorithm 3, §5.1, Table 2.
"""

import ml_collections

from configs import common
from configs import default

_DC = {"lam": 0.2, "form": "full"}
RULES = {
    "wp3": {"optimizer_wrapper": ("WeightPrediction", {"option": 3, **_DC})},
    "wp1": {"optimizer_wrapper": ("WeightPrediction", {"option": 1})},
    "wp2": {"optimizer_wrapper": ("WeightPrediction", {"option": 2})},
    "dc": {"transforms": (("stale_gradients", {"delay": 1}),
                          ("delay_compensation", {**_DC, "delay": 1}))},
    "pipesgd": {"transforms": (("stale_gradients", {"delay": 1}),)},
    "sync": {},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="mlp_digits", rule="wp3")
  if arg.rule not in RULES:
    raise ValueError(f"rule {arg.rule!r} is invalid; valid: "
                     f"{', '.join(RULES)}")
  config = default.get_config(f"variant={arg.variant}")
  config.schedule = "gpipe"
  config.num_stages = 1
  config.num_replicas = 8
  config.num_microbatches = 1
  config.microbatch_size = 16  # 128 examples per step over 8 replicas
  config.sync = "bsp"
  config.optimizer = "sgd"
  config.optimizer_kwargs = ml_collections.ConfigDict(
      {"learning_rate": 0.1, "momentum": 0.9})
  config.weight_decay = 5e-5
  config.weight_decay_mode = "l2"
  for key, value in RULES[arg.rule].items():
    config[key] = value
  return config
