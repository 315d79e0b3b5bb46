r"""Each small model learns its data set: one model/data variant per run.

configs/default.py's variant cut into 4 stages on one replica, GPipe with
one micro-batch (unpipelined training: tests/gpipe_executor_test.py), Adam,
300 steps of batch 64 (32 windows for chars). The hook writes the first and
last training loss, the parameter count and the chance-level references to
`figures.json`.
  mkdir -p runs/small_models
  for r in mlp_synthetic vgg_digits resnet_digits transformer_chars; do
    for s in 0 1 2; do
      python launch.py --config=configs/experiments/small_models.py:variant=$r,seed=$s \
          --workdir=runs/small_models/$r-$s \
          2> runs/small_models/$r-$s.err; done; done
  python experiments/summarize.py --runs='runs/small_models/*' \
      --keys=num_params,first_loss,last_loss,test_accuracy,test_loss,majority_accuracy,unigram_bits
"""

import ml_collections

from configs import common
from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, variant="mlp_synthetic", seed=0)
  config = default.get_config(f"variant={arg.variant}")
  config.update(seed=arg.seed, num_replicas=1, num_microbatches=1,
                minibatches_per_window=1, num_steps=300, eval_every=0,
                checkpoint_every=0, plots=False, log_every=100)
  config.microbatch_size = 32 if config.dataset == "chars" else 64
  config.hooks = (("experiments.hooks:LearnsItsData", {}),)
  return config
