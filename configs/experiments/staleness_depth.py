r"""Steps to a validation loss against pipeline depth (docs/staleness_depth.md).

  mkdir -p runs/staleness_depth
  for m in 1f1b pipedream zb_async pipemare nesterov spectrain sapipe_wp dc basis_rotation; do
    for S in 1 2 4 8 16 32; do for s in 0 1 2; do
      nice -n 10 python launch.py --config=configs/experiments/staleness_depth.py:method=$m,stages=$S,seed=$s \
          --workdir=runs/staleness_depth/$m-S$S-$s 2> runs/staleness_depth/$m-S$S-$s.err; done; done; done
  python experiments/staleness_depth.py --runs='runs/staleness_depth/*' --out_dir=runs/staleness_depth
  python experiments/summarize.py --runs='runs/staleness_depth/*' --keys=test_loss,final_training_loss
"""

from configs import common
from configs import default
from configs import pipedream_dc
from configs import sapipe

_STALE = {"schedule_kwargs": {"weight_stashing": False}}
METHODS = {  # fields over PipeDream with AdamW; "sgd": an Adam-like transform
    "1f1b": {"schedule": "1f1b"}, "pipedream": {},
    "sapipe_wp": sapipe.RULES["wp3"],
    "zb_async": {"schedule": "zb-async", "remat": "residuals"},
    "pipemare": {**_STALE, "optimizer_wrapper": ("PipeMare", {
        "warmup_steps": 100, "decay": 0.5})},
    "spectrain": {**_STALE, "optimizer_wrapper": ("SpecTrain", {
        "staleness": "pipeline"})},
    "dc": {"transforms": pipedream_dc.get_config().transforms,
           "optimizer_scope": "stage"},
    "nesterov": {"transforms": (("scale_by_async_nesterov", {}),),
                 "optimizer": "sgd", "grad_clip_norm": 10.0},
    "basis_rotation": {"transforms": (("scale_by_basis_rotation", {
        "mask": "attention_mlp"}),),
                       "optimizer": "sgd"}}


def get_config(arg=None):
  arg = common.parse_arg(arg, method="pipedream", stages=32, seed=0,
                         d_model=32, lr=1e-3)
  config = default.get_config("variant=transformer_stdlib")
  M = arg.stages if arg.method == "zb_async" else 1  # zero bubble: M >= S - 1
  config.update(dict(
      seed=arg.seed, schedule="pipedream", num_stages=arg.stages,
      stage_devices=1, num_replicas=1, num_microbatches=M,
      microbatch_size=16 // M, minibatches_per_window=8, optimizer="adam",
      weight_decay=0.01, weight_decay_mode="decoupled", num_steps=288,
      eval_every=24, checkpoint_every=0, plots=False), **METHODS[arg.method])
  config.dataset_kwargs.seq_len = 64
  config.model_kwargs.update(d_model=arg.d_model, num_layers=32)
  config.optimizer_kwargs.learning_rate = arg.lr
  return config
