r"""Steps to a validation loss against pipeline depth (docs/staleness_depth.md).

One run a (method, S, seed, step size):

  python launch.py --config=configs/experiments/staleness_depth.py:method=pipedream,stages=8,seed=0,lr=1e-3 \
      --workdir=runs/staleness_depth/pipedream@1e-3-S8-0
  python experiments/staleness_depth.py --runs='runs/staleness_depth/*' --out_dir=runs/staleness_depth
  python experiments/summarize.py --runs='runs/staleness_depth/*' --keys=test_loss,final_training_loss

`:d_model=`, `:windows=` (per step), `:seq_len=`, `:steps=`, `:eval_every=`
and `:eval_windows=` set the operating point (the doc says which it uses).

Every row is PipeDream with AdamW (b1 0.9, b2 0.999, decoupled weight decay
0.01) at the `:lr=` step size, held constant (no rule's own warm-up or
cosine), plus the fields of `configs/rules.py` (`:method=` names one; each
cited there, file and line of its source).
"""

from configs import common
from configs import default
from configs import rules

METHODS = rules.DEPTH


def get_config(arg=None):
  arg = common.parse_arg(arg, method="pipedream", stages=32, seed=0,
                         d_model=32, lr=1e-3, windows=16, seq_len=64,
                         steps=288, eval_every=24, eval_windows=256)
  common.check_choice("method", arg.method, METHODS)
  M = arg.stages if arg.method == "zb_async" else 1  # zero bubble: M >= S - 1
  if arg.windows % M:
    raise ValueError(f"windows={arg.windows} is invalid for {arg.method} at "
                     f"stages={arg.stages}; valid: a multiple of {M}, its "
                     "micro-batches")
  config = default.get_config("variant=transformer_stdlib")
  config.update(dict(  # one evaluation past the tables' last: the drained one
      seed=arg.seed, schedule="pipedream", num_stages=arg.stages,
      stage_devices=1, num_replicas=1, num_microbatches=M,
      microbatch_size=arg.windows // M, minibatches_per_window=8,
      optimizer="adam", weight_decay=0.01, weight_decay_mode="decoupled",
      num_steps=arg.steps + arg.eval_every, eval_every=arg.eval_every,
      checkpoint_every=0, plots=False), **METHODS[arg.method])
  config.dataset_kwargs.update(seq_len=arg.seq_len,
                               max_test_windows=arg.eval_windows)
  config.model_kwargs.update(d_model=arg.d_model, num_layers=32)
  config.optimizer_kwargs.learning_rate = arg.lr
  return config
