r"""SAPipe Table 2 on digits: one row (`rule`) and seed per run.

configs/sapipe.py (8 data replicas x 1 stage, SGD momentum 0.9, the gradient
applied one step late) at lr 0.15 for 400 steps, the MLP on digits; the seed
draws the weights and the data split. Every row and seed:
  mkdir -p runs/sapipe_table2
  for r in sync pipesgd dc wp1 wp2 wp3; do for s in 0 1 2; do
    python launch.py --config=configs/experiments/sapipe_table2.py:rule=$r,seed=$s \
        --workdir=runs/sapipe_table2/$r-$s \
        2> runs/sapipe_table2/$r-$s.err; done; done
  python experiments/summarize.py --runs='runs/sapipe_table2/*'
Rows as in configs/sapipe.py: sync (no staleness), pipesgd, dc, wp1-wp3.
"""

import ml_collections

from configs import common
from configs import sapipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, rule="wp3", seed=0)
  config = sapipe.get_config(f"rule={arg.rule}")
  config.seed = config.dataset_kwargs.seed = arg.seed
  config.num_steps = 400
  config.optimizer_kwargs.learning_rate = 0.15
  config.update(eval_every=0, checkpoint_every=0, plots=False)
  return config
