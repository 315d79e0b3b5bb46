r"""Staleness compensation on digits: one update rule, step size and seed.

configs/sapipe.py's data-parallel setting (the gradient applied one step
late) on 4 replicas x batch 32, a 64-128-128-10 MLP, SGD momentum 0.9,
300 steps; the seed draws the weights and the minibatch order on one fixed
split. Rules: configs/sapipe.py's sync, pipesgd, dc (full), wp1-wp3,
plus dc_diagonal and nesterov (stale gradients into the asynchronous
Nesterov update, at lr x 0.02 as it is Adam-like).
  mkdir -p runs/staleness_convergence
  for lr in 0.05 0.15; do for r in sync pipesgd dc_diagonal dc wp1 wp2 wp3 nesterov; do
    for s in 0 1 2; do
      python launch.py --config=configs/experiments/staleness_convergence.py:rule=$r,lr=$lr,seed=$s \
          --workdir=runs/staleness_convergence/lr$lr-$r-$s \
          2> runs/staleness_convergence/lr$lr-$r-$s.err; done; done; done
  python experiments/summarize.py --runs='runs/staleness_convergence/*'
"""

import ml_collections

from configs import common
from configs import sapipe

_STALE = ("stale_gradients", {"delay": 1})
RULES = {"dc_diagonal": (_STALE, ("delay_compensation", {"lam": 0.2})),
         "nesterov": (_STALE, ("scale_by_async_nesterov", {}))}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, rule="wp3", lr=0.05, seed=0)
  config = sapipe.get_config(f"rule={'sync' if arg.rule in RULES else arg.rule}")
  config.transforms = RULES.get(arg.rule, config.transforms)
  config.seed = arg.seed
  config.update(num_replicas=4, microbatch_size=32, weight_decay=0.0,
                num_steps=300, eval_every=0, checkpoint_every=0, plots=False)
  config.model_kwargs.num_hidden_layers = 2
  config.optimizer_kwargs.learning_rate = arg.lr
  if arg.rule == "nesterov":
    config.optimizer_kwargs = {"learning_rate": arg.lr * 0.02}
  return config
