"""Turns a config into a run: mesh, data, model, pipeline, loop, metrics.

One linear file with labelled sections, after big_vision's `train.py` and the
Flax examples' `train.py`.
"""

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from stalepipe import data as data_lib
from stalepipe import models
from stalepipe import schedules
from stalepipe.pipeline import executor

_DATASETS = {"digits": data_lib.digits}


def _choose(registry: dict, name: str, what: str):
  if name not in registry:
    raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
  return registry[name]


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The optax optimizer named by `config.optimizer` with its kwargs."""
  factory = getattr(optax, config.optimizer, None)
  if factory is None or not callable(factory):
    raise ValueError(f"unknown optimizer {config.optimizer!r}; valid: an optax "
                     "alias such as sgd, adam, adamw")
  return factory(**config.optimizer_kwargs)


def make_mesh(num_replicas: int, num_stages: int) -> jax.sharding.Mesh:
  """A ('data', 'stage') mesh over the first D * S devices."""
  devices = jax.devices()
  need = num_replicas * num_stages
  if need > len(devices):
    raise ValueError(
        f"mesh num_replicas x num_stages = {num_replicas} x {num_stages} = "
        f"{need} devices does not fit the {len(devices)} "
        f"{devices[0].platform.upper()} devices here; valid: at most "
        f"{len(devices)}")
  grid = np.asarray(devices[:need]).reshape(num_replicas, num_stages)
  return jax.sharding.Mesh(grid, (executor.DATA, executor.STAGE))


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy over a micro-batch."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class _Progress:
  """A one-line progress bar on stderr."""

  def __init__(self, total: int):
    self.total, self.start = total, time.time()

  def show(self, done: int, loss: float):
    width = 30
    filled = int(width * done / self.total)
    rate = done / max(time.time() - self.start, 1e-9)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                     f"{done}/{self.total} loss {loss:.4f} {rate:.1f} steps/s")
    if done == self.total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, Any]:
  """Trains per `config`, writing `config.json` and `metrics.jsonl` to `workdir`.

  Returns:
    The summary: final loss, test accuracy, steps (minibatches) per second.
  """
  # Mesh.
  mesh = make_mesh(config.num_replicas, config.num_stages)
  is_writer = jax.process_index() == 0

  # Input.
  dataset = _choose(_DATASETS, config.dataset, "dataset")(seed=config.seed)
  D, M, B = config.num_replicas, config.num_microbatches, config.minibatches_per_window
  b = config.microbatch_size
  minibatch_size = M * D * b
  if minibatch_size > len(dataset.x_train):
    raise ValueError(f"minibatch of {minibatch_size} examples exceeds the "
                     f"{len(dataset.x_train)} training examples")

  # Model and optimizer.
  blocks = models.make(config.model, in_features=dataset.x_train.shape[-1],
                       num_classes=dataset.num_classes, seed=config.seed,
                       **config.model_kwargs)
  boundaries = (tuple(config.stage_boundaries) if config.stage_boundaries
                else config.num_stages)
  if isinstance(boundaries, int) and not 1 <= boundaries <= len(blocks):
    raise ValueError(f"num_stages={boundaries} does not fit the model's "
                     f"{len(blocks)} blocks; valid: 1 to {len(blocks)}")
  staged = models.split(blocks, boundaries)
  if len(staged.stage_fns) != config.num_stages:
    raise ValueError(f"stage_boundaries {config.stage_boundaries} give "
                     f"{len(staged.stage_fns)} stages; valid: "
                     f"num_stages={config.num_stages} boundaries")
  schedule = schedules.make(config.schedule, num_stages=config.num_stages,
                            num_microbatches=M, num_minibatches=B,
                            **config.schedule_kwargs)
  pipe = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                           make_optimizer(config), mesh)
  state = pipe.init(staged.stage_params)
  model_fn = jax.jit(models.unpipelined(staged))

  # Loop.
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))
  rng = np.random.default_rng(config.seed)
  num_windows = max(1, config.num_steps // B)
  progress = _Progress(num_windows * B)
  order, cursor = rng.permutation(len(dataset.x_train)), 0
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  start, loss = None, float("nan")
  with open(metrics_path, "w") if is_writer else open(os.devnull, "w") as log:
    for window in range(1, num_windows + 1):
      need = B * minibatch_size
      if cursor + need > len(order):
        order, cursor = rng.permutation(len(dataset.x_train)), 0
      idx = order[cursor:cursor + need].reshape(B, M, D * b)
      cursor += need
      state, metrics = pipe.step(state, dataset.x_train[idx],
                                 dataset.y_train[idx])
      if start is None:  # time the steady state, after compilation
        jax.block_until_ready(metrics)
        start = time.time()
      if window % config.log_every == 0 or window == num_windows:
        loss = float(metrics["loss"])
        steps = window * B
        rate = (steps - B) / max(time.time() - start, 1e-9)
        log.write(json.dumps({"step": steps, "loss": loss,
                              "steps_per_s": rate}) + "\n")
        log.flush()
        if is_writer:
          progress.show(steps, loss)
  elapsed = time.time() - start
  steps_per_s = (num_windows - 1) * B / elapsed if num_windows > 1 else 0.0

  # Evaluation.
  logits = model_fn(pipe.params(state), jnp.asarray(dataset.x_test))
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == dataset.y_test))
  summary = {"final_loss": loss, "test_accuracy": accuracy,
             "steps": num_windows * B, "steps_per_s": steps_per_s,
             "seconds": elapsed}
  if is_writer:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary
