r"""Default: an MLP on digits, GPipe over 4 stages x 2 data replicas.

Run:
  python launch.py --config=configs/default.py --workdir=runs/default

Model and data variants (`:variant=NAME`): mlp_digits (default),
mlp_synthetic, vgg_digits, resnet_digits, vgg_cifar10, resnet_cifar10,
transformer_chars, transformer_stdlib, e.g.
  python launch.py --config=configs/default.py:variant=transformer_chars
Every method config takes the same variants. Override any field, e.g.
`--config.num_microbatches=8`; CIFAR-10 reads the python-pickle batches from
`--config.dataset_kwargs.data_dir=DIR`. transformer_stdlib is one decoder
layer per stage: keep `model_kwargs.num_layers` equal to `num_stages`, e.g.
  python launch.py --config=configs/default.py:variant=transformer_stdlib \
    --config.num_stages=8 --config.num_replicas=1 \
    --config.model_kwargs.num_layers=8 --config.model_kwargs.dtype=bfloat16
"""

import ml_collections

from configs import common

_DIGITS_IMAGE = {"input_shape": (8, 8, 1)}
_CIFAR10 = {"dataset": "cifar10",
            "dataset_kwargs": {"data_dir": "~/data/cifar-10-batches-py"},
            "num_steps": 2000}
VARIANTS = {
    "mlp_digits": {},
    "mlp_synthetic": {
        "dataset": "synthetic",
        "dataset_kwargs": {"num_train": 4096, "num_test": 1024,
                           "in_features": 32, "num_classes": 10, "seed": 0}},
    "vgg_digits": {
        **_DIGITS_IMAGE, "model": "vgg",
        "model_kwargs": {"stages": ((16, 16), (32, 32)), "dense": (64,)}},
    "resnet_digits": {
        **_DIGITS_IMAGE, "model": "resnet",
        "model_kwargs": {"stem_width": 16, "widths": (16, 32),
                         "depths": (1, 1)}},
    "vgg_cifar10": {
        **_CIFAR10, "model": "vgg",
        "model_kwargs": {"stages": ((32, 32), (64, 64)), "dense": (128,)}},
    "resnet_cifar10": {**_CIFAR10, "model": "resnet", "model_kwargs": {}},
    "transformer_chars": {
        "dataset": "chars", "dataset_kwargs": {"seq_len": 64},
        "model": "transformer", "loss": "lm_cross_entropy",
        "model_kwargs": {"d_model": 64, "num_heads": 4, "num_layers": 2},
        "optimizer_kwargs": {"learning_rate": 3e-3}, "microbatch_size": 4},
    "transformer_stdlib": {
        "dataset": "stdlib",
        "dataset_kwargs": {"seq_len": 128, "max_test_windows": 256,
                           "cache_dir": "~/.cache/stalepipe"},
        "model": "transformer", "loss": "lm_cross_entropy",
        "model_kwargs": {"d_model": 64, "num_heads": 4, "num_layers": 4,
                         "fuse_ends": True, "positions": "learned",
                         "dtype": "float32"},
        "optimizer_kwargs": {"learning_rate": 3e-3}, "microbatch_size": 4},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default experiment, with the model/data variant named in `arg`."""
  arg = common.parse_arg(arg, variant="mlp_digits")
  if arg.variant not in VARIANTS:
    raise ValueError(f"variant {arg.variant!r} is invalid; valid: "
                     f"{', '.join(VARIANTS)}")
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Data and model, chosen by name (stalepipe.data, stalepipe.models).
  config.dataset = "digits"
  config.dataset_kwargs = ml_collections.ConfigDict({"seed": 0})
  config.input_shape = ()  # reshape each example to this; () = as loaded
  config.model = "mlp"
  config.model_kwargs = ml_collections.ConfigDict(
      {"hidden": 128, "num_hidden_layers": 3})
  config.loss = "cross_entropy"  # stalepipe.models.losses
  # Pipeline: mesh ('data', 'stage') = (num_replicas, stage_devices).
  config.schedule = "gpipe"
  config.schedule_kwargs = ml_collections.ConfigDict()
  config.num_stages = 4
  config.num_replicas = 2
  config.stage_boundaries = ()  # first block of each stage; () = even split
  config.num_microbatches = 4
  config.microbatch_size = 8  # examples per micro-batch per data replica
  config.minibatches_per_window = 4  # minibatches per jitted pipeline step
  # Devices on the mesh's 'stage' axis (0: num_stages): each runs
  # num_stages / stage_devices stages, placed by `placement`
  # (stalepipe.pipeline.placement: "consecutive", "loop" or "v"); the
  # trained weights are the same whatever the folding, to float rounding.
  config.stage_devices = 0
  # Devices each stage is sharded over (a third mesh axis 'fsdp',
  # stalepipe.pipeline.fsdp): weights, every stashed version, gradient
  # accumulator and optimizer state cut per leaf; each device takes
  # microbatch_size / fsdp examples of a micro-batch. 1: a stage a device.
  config.fsdp = 1
  # The memory a device may give the state (weights with every stashed
  # version, optimizer state, accumulator), in MiB; a run that needs more is
  # refused before it starts, naming fsdp. 0: no limit.
  config.device_memory_mib = 0.0
  config.placement = "consecutive"
  # "recompute": a backward task recomputes its forward from the kept input;
  # "residuals": the forward keeps its jax.vjp residuals (more memory).
  config.remat = "recompute"
  # How a tick runs a device's slots (stalepipe.pipeline.lanes): "auto",
  # "slots" (every slot every tick) or "lanes" (only the busy ones; the same
  # numbers, and the same checkpoints).
  config.tick = "auto"
  # How a device holds its stages' weight versions (stalepipe.pipeline.pool):
  # "slots" (one ring a slot, each as deep as its deepest stage) or "pooled"
  # (one pool a device, the schedule's per-device figure; the same numbers).
  config.stash = "slots"
  # What the update rule steps on (stalepipe.pipeline.scope): "auto" (the
  # whole model where the rule couples stages, e.g. grad_clip_norm), "model"
  # or "stage" (each stage's own tree).
  config.optimizer_scope = "auto"
  # Synchronisation across the data replicas (stalepipe.sync).
  config.sync = "bsp"
  config.sync_kwargs = ml_collections.ConfigDict()
  # Optimization (stalepipe.train.optimizers): (name, kwargs) transforms from
  # stalepipe.optim, applied in order before the optax optimizer named by
  # `optimizer`; an optax schedule (name, kwargs) replaces its learning_rate,
  # e.g. ("warmup_cosine_decay_schedule", {"init_value": 0.0,
  # "peak_value": 1e-3, "warmup_steps": 50, "decay_steps": 800}).
  config.transforms = ()
  config.optimizer = "adam"
  config.optimizer_kwargs = ml_collections.ConfigDict({"learning_rate": 1e-3})
  config.lr_schedule = ()  # () = the constant learning_rate
  config.weight_decay = 0.0
  config.weight_decay_mode = "l2"  # "l2" (into the gradient) or "decoupled"
  config.grad_clip_norm = 0.0  # global-norm clipping; 0 = off
  # A stalepipe.optim wrapper of the whole chain, (name, kwargs), e.g.
  # ("WeightPrediction", {"option": 3, "lam": 0.2}); () = none.
  config.optimizer_wrapper = ()
  config.num_steps = 800  # minibatches
  # Logging, evaluation and checkpoints; intervals in steps (minibatches),
  # each honoured at the end of the window that reaches it; 0 = only at the
  # end.
  config.log_every = 40
  config.eval_every = 200
  config.checkpoint_every = 200
  config.keep_checkpoints = 2
  config.plots = True
  # More hooks run every N steps (stalepipe.train.loop): ("module:factory",
  # kwargs) pairs, each called as factory(parts, workdir, **kwargs), e.g.
  # (("experiments.hooks:StageNorms", {"every": 100}),).
  config.hooks = ()

  for key, value in VARIANTS[arg.variant].items():
    config[key] = (ml_collections.ConfigDict(value) if isinstance(value, dict)
                   else value)
  return config
