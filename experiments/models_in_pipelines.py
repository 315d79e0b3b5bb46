"""Every model and data set through every schedule: executor against oracle.

Cuts each small model into 4 stages, feeds it windows of its data set, and
runs two windows of every schedule in `stalepipe.schedules` with plain SGD on
both the sequential oracle (`stalepipe.pipeline.reference`) and the shard_map
executor (`stalepipe.pipeline.executor`, mesh 2 data x 4 stages on 8 emulated
CPU devices). It prints the last window's loss of each and the largest
parameter difference between them. Run:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    .venv/bin/python experiments/models_in_pipelines.py [--out_dir=DIR]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

import harness  # pylint: disable=g-import-not-at-top
import stalepipe as sp  # pylint: disable=g-import-not-at-top
from stalepipe.pipeline import executor, reference  # pylint: disable=g-import-not-at-top

STAGES, MICRO, MINI, BATCH, DATA = 4, 4, 2, 4, 2  # 2bw needs MICRO >= STAGES
SCHEDULE_KWARGS = {"hetpipe": dict(concurrent_minibatches=2)}


def digits_images():
  ds = sp.data.digits()
  return ds.x_train.reshape(-1, 8, 8, 1), ds.y_train


def chars_windows():
  ds = sp.data.chars(32)
  return ds.x_train, ds.y_train


# name, (x, y) loader, model kwargs, loss.
MODELS = [
    ("mlp / synthetic",
     lambda: sp.data.synthetic(512, 1)[:2],
     dict(name="mlp", in_features=32, hidden=32, num_hidden_layers=3,
          num_classes=10), sp.models.losses.cross_entropy),
    ("vgg / digits", digits_images,
     dict(name="vgg", num_classes=10, image_size=8, in_channels=1,
          stages=((8,), (16,)), dense=(32,)), sp.models.losses.cross_entropy),
    ("resnet / digits", digits_images,
     dict(name="resnet", num_classes=10, in_channels=1, stem_width=8,
          widths=(8, 16), depths=(1, 1)), sp.models.losses.cross_entropy),
    ("transformer / chars", chars_windows,
     dict(name="transformer", vocab_size=sp.data.chars_vocab().size,
          d_model=16, num_heads=2, num_layers=2, max_len=32),
     sp.models.losses.lm_cross_entropy),
]


def windows(x, y, count):
  """`count` windows of [B, M, DATA * b, ...] rows taken in order."""
  n = MINI * MICRO * DATA * BATCH
  for k in range(count):
    rows = slice(k * n, (k + 1) * n)
    yield (x[rows].reshape(MINI, MICRO, DATA * BATCH, *x.shape[1:]),
           y[rows].reshape(MINI, MICRO, DATA * BATCH, *y.shape[1:]))


def main(argv):
  del argv
  mesh = jax.make_mesh((DATA, STAGES), ("data", "stage"))
  half = jax.make_mesh((DATA, STAGES // 2), ("data", "stage"),
                       devices=jax.devices()[:DATA * STAGES // 2])
  print("| model / data | schedule | oracle loss | executor loss | "
        "max abs param diff |")
  print("|---|---|---:|---:|---:|")
  results = {}
  for name, load, model_kwargs, loss_fn in MODELS:
    x, y = load()
    kwargs = dict(model_kwargs)
    staged = sp.models.split(sp.models.make(kwargs.pop("name"), **kwargs),
                             STAGES)
    for schedule_name in sp.schedules.names():
      # A device-level schedule holds two of the stages a device.
      chunked = schedule_name in sp.schedules.DEVICE_LEVEL
      options = dict(SCHEDULE_KWARGS.get(schedule_name, {}))
      if sp.schedules.takes_num_devices(schedule_name):
        options["num_devices"] = STAGES // 2
      try:
        schedule = sp.schedules.make(
            schedule_name, num_stages=STAGES, num_microbatches=MICRO,
            num_minibatches=MINI, **options)
      except ValueError as e:  # e.g. one micro-batch a minibatch only
        print(f"| {name} | {schedule_name} | not run: {e} | | |")
        continue
      oracle = reference.Pipeline(staged.stage_fns, loss_fn, schedule,
                                  optax.sgd(0.05))
      pipe = executor.Pipeline(staged.stage_fns, loss_fn, schedule,
                               optax.sgd(0.05), half if chunked else mesh)
      oracle_state = oracle.init(staged.stage_params)
      state = pipe.init(staged.stage_params)
      for inputs, targets in windows(x, y, 2):
        oracle_state, oracle_metrics = oracle.step(oracle_state, inputs,
                                                   targets)
        state, metrics = pipe.step(state, inputs, targets)
      diff = max(float(np.abs(a - b).max()) for a, b in zip(
          jax.tree.leaves(oracle.params(oracle_state)),
          jax.tree.leaves(pipe.params(state))))
      results[f"{name}, {schedule_name}"] = {
          "oracle_loss": float(oracle_metrics["loss"]),
          "executor_loss": float(metrics["loss"]), "max_abs_param_diff": diff}
      print(f"| {name} | {schedule_name} | "
            f"{float(oracle_metrics['loss']):.4f} | "
            f"{float(metrics['loss']):.4f} | {diff:.1e} |", flush=True)
  harness.record("models_in_pipelines", results)


if __name__ == "__main__":
  harness.run(main)
