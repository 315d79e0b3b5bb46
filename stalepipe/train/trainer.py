"""Turns a config into a run: mesh, input, model, pipeline, checkpoint, loop.

One linear file with labelled sections, after big_vision's `train.py` and the
Flax examples' `train.py`. A run writes into its workdir:

- `config.json`, `metrics.jsonl`, `tb/` (TensorBoard), `summary.json`,
  `loss.png`, `schedule.png`, `params.npz` (the final weights);
- `checkpoints/<window>/`: the whole pipeline state and the trainer's
  position. A run started on a workdir that holds a checkpoint resumes from
  it and ends with exactly the parameters of the uninterrupted run.

The config is checked whole (`validate.check`) before anything is built,
and the workdir is written only once the run is built. SIGTERM or SIGINT
stops the run after the current window with a checkpoint (once training is
over, the final evaluation and files are finished first); a NaN or inf loss
stops it, naming the step, without saving the broken state (the last good
checkpoint stays). A failure closes the checkpoint manager and the writers
on its way out, so the process always ends.
"""

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from stalepipe import models
from stalepipe import schedules
from stalepipe import sync as sync_lib
from stalepipe.models import losses
from stalepipe.pipeline import executor
from stalepipe.train import checkpoint as checkpoint_lib
from stalepipe.train import input_pipeline
from stalepipe.train import metrics as metrics_lib
from stalepipe.train import optimizers
from stalepipe.train import preemption as preemption_lib
from stalepipe.train import validate

LOSSES = {"cross_entropy": losses.cross_entropy,
          "lm_cross_entropy": losses.lm_cross_entropy}
_EVAL_BATCH = 512


def make_mesh(num_replicas: int, num_stages: int) -> jax.sharding.Mesh:
  """A ('data', 'stage') mesh over the first D * S devices of all processes."""
  devices = jax.devices()
  need = num_replicas * num_stages
  if need > len(devices):
    raise ValueError(
        f"mesh num_replicas x num_stages = {num_replicas} x {num_stages} = "
        f"{need} devices does not fit the {len(devices)} "
        f"{devices[0].platform.upper()} devices here; valid: at most "
        f"{len(devices)}")
  if jax.process_count() > 1 and need != len(devices):
    raise ValueError(
        f"mesh num_replicas x num_stages = {need} devices leaves some of the "
        f"{jax.process_count()} processes without a device; valid: exactly "
        f"{len(devices)} (all devices of all processes)")
  return jax.make_mesh((num_replicas, num_stages),
                       (executor.DATA, executor.STAGE), devices=devices[:need])


def model_kwargs(name: str, example: np.ndarray, num_classes: int
                 ) -> dict[str, Any]:
  """The model arguments the data decide (widths of input and output)."""
  if name == "mlp":
    return {"in_features": int(np.prod(example.shape)),
            "num_classes": num_classes}
  if name in ("vgg", "resnet"):
    if example.ndim != 3:
      raise ValueError(f"model {name!r} needs images [h, w, c], not examples "
                       f"of shape {example.shape}; valid: set input_shape")
    extra = {"image_size": example.shape[0]} if name == "vgg" else {}
    return {"num_classes": num_classes, "in_channels": example.shape[-1],
            **extra}
  if name == "transformer":
    return {"vocab_size": num_classes, "max_len": example.shape[0]}
  raise ValueError(f"unknown model {name!r}; valid: "
                   f"{', '.join(models.names())}")


@jax.jit
def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf is finite (no NaN, no inf)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                            for x in jax.tree.leaves(tree)]))


def evaluate(model_fn, params, x: np.ndarray, y: np.ndarray,
             loss_fn) -> tuple[float, float]:
  """Mean loss and accuracy (per label: per token for a language model)."""
  total_loss, correct, count = 0.0, 0.0, 0
  for i in range(0, len(x), _EVAL_BATCH):
    logits = model_fn(params, jnp.asarray(x[i:i + _EVAL_BATCH]))
    labels = jnp.asarray(y[i:i + _EVAL_BATCH])
    total_loss += float(loss_fn(logits, labels)) * len(labels)
    correct += float(jnp.sum(jnp.argmax(logits, -1) == labels))
    count += len(labels)
  return total_loss / count, correct / (count * np.prod(y.shape[1:]))


def _finished_summary(workdir: str, num_steps: int) -> dict[str, Any] | None:
  """The summary of a run in `workdir` that already ended at `num_steps`."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  return summary if summary.get("steps") == num_steps else None


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, Any]:
  """Trains per `config` in `workdir`, resuming from its latest checkpoint.

  A workdir whose run already ended at `config.num_steps` (its summary and
  final checkpoint written) is left as it is and its summary returned, with
  `already_finished` set.

  Returns:
    The summary: final loss, test accuracy, steps (minibatches), throughput,
    and `preempted` (the signal's name) if a signal stopped the run.

  Raises:
    ValueError: on a bad config, no checkpoint that verifies, a foreign
      checkpoint, `num_steps` below the checkpoint's step, or a NaN/inf loss
      (naming the step).
    checkpoint_lib.CheckpointError: if a checkpoint cannot be written.
  """
  validate.check(config)
  with preemption_lib.Preemption() as preemption:
    return _train(config, workdir, preemption)


def _train(config: ml_collections.ConfigDict, workdir: str,
           preemption: preemption_lib.Preemption) -> dict[str, Any]:
  """`train_and_evaluate` with the signal handler already in place."""
  config_dict = json.loads(config.to_json())
  is_writer = jax.process_index() == 0

  # Mesh.
  D, S = config.num_replicas, config.num_stages
  M, B, b = (config.num_microbatches, config.minibatches_per_window,
             config.microbatch_size)
  num_windows = config.num_steps // B
  mesh = make_mesh(D, S)
  local = [r for r in range(D) if any(
      d.process_index == jax.process_index() for d in mesh.devices[r])]

  # Input: this process loads only the shards of its own data replicas.
  shards = []
  for r in local:
    ds = input_pipeline.load(config.dataset, dict(config.dataset_kwargs), r, D,
                             config.input_shape)
    shards.append(input_pipeline.Shard(r, ds.x_train, ds.y_train))
  x_test, y_test, num_classes = ds.x_test, ds.y_test, ds.num_classes

  def batch(window):
    return input_pipeline.window_batch(shards, window, B, M, b, config.seed)

  # Model, optimizer and pipeline.
  loss_fn = LOSSES[config.loss]
  blocks = models.make(config.model, seed=config.seed, **config.model_kwargs,
                       **model_kwargs(config.model, x_test[0], num_classes))
  staged = models.split(blocks, tuple(config.stage_boundaries) or S)
  if len(staged.stage_fns) != S:
    raise ValueError(f"stage_boundaries {config.stage_boundaries} give "
                     f"{len(staged.stage_fns)} stages; valid: "
                     f"num_stages={S} boundaries")
  schedule = schedules.make(config.schedule, num_stages=S, num_microbatches=M,
                            num_minibatches=B, **config.schedule_kwargs)
  optimizer = optimizers.from_config(config, num_replicas=D)
  sync_kwargs = dict(config.sync_kwargs)
  if config.sync == "wsp":  # a wave is the schedule's N_m minibatches
    sync_kwargs.setdefault("concurrent_minibatches",
                           schedule.options.get("concurrent_minibatches", 1))
  sync = sync_lib.make(config.sync, num_replicas=D, **sync_kwargs)
  pipe = executor.Pipeline(staged.stage_fns, loss_fn, schedule, optimizer,
                           mesh, sync=sync,
                           remat=config.get("remat", "recompute"),
                           optimizer_scope=config.get("optimizer_scope",
                                                      "auto"))
  model_fn = jax.jit(models.unpipelined(staged))
  batch(0)  # a window that does not fit the data fails here, not later

  # Checkpoint: resume from the workdir's newest checkpoint that verifies.
  finished = _finished_summary(workdir, config.num_steps)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     keep=config.keep_checkpoints)
  console = metrics_lib.Progress(config.num_steps, is_writer)
  writer = None
  try:
    if finished is not None and ckpt.latest_step() == num_windows:
      console.close()
      return dict(finished, already_finished=True)
    restored, first = None, 0
    if ckpt.latest_step() is not None:
      restored = ckpt.restore(
          pipe.abstract_state(staged.stage_params, *batch(0)), config_dict)
    for line in ckpt.skipped:
      console.print(f"skipped checkpoint {line}")
    if restored is not None:
      state, position = restored
      first = position["window"]
      if first > num_windows:
        raise ValueError(
            f"num_steps={config.num_steps} is below step {first * B} of "
            f"checkpoint {ckpt.directory}/{first}; valid: num_steps >= "
            f"{first * B} to continue it, or a new --workdir")
      console.print(f"resuming from checkpoint {ckpt.directory}/{first} "
                    f"(step {first * B})")
    else:
      state = pipe.init(staged.stage_params)
    if is_writer:
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    writer = metrics_lib.Writer(
        workdir, is_writer, resume_step=None if restored is None else first * B)
    return _loop(config, workdir, pipe, state, first, restored is not None,
                 batch, ckpt, writer, console, preemption, model_fn, loss_fn,
                 (x_test, y_test), schedule, config_dict)
  finally:  # whatever happened: pending saves end, threads and files close
    console.close()
    try:
      ckpt.wait()
    finally:
      ckpt.close()
      if writer is not None:
        writer.close()


def _loop(config, workdir, pipe, state, first, resumed, batch, ckpt, writer,
          console, preemption, model_fn, loss_fn, test, schedule,
          config_dict) -> dict[str, Any]:
  """The training loop, then the final evaluation, summary and plots."""
  is_writer = jax.process_index() == 0
  D, S = config.num_replicas, config.num_stages
  M, B, b = (config.num_microbatches, config.minibatches_per_window,
             config.microbatch_size)
  num_windows = config.num_steps // B
  examples_per_step = M * D * b
  static = {"bubble": schedule.bubble_fraction}
  # [replicas, minibatches]: what each forward missed, sync policy included.
  observed = sync_lib.ObservedStaleness(schedule, pipe.sync, num_windows * B)

  def check(window, step_metrics):
    """Stops on a NaN/inf loss; the broken state is never saved."""
    loss = float(step_metrics["loss"])
    if int(step_metrics["num_losses"]) > 0 and not np.isfinite(loss):
      ckpt.wait()
      last = ckpt.latest_step()
      kept = (f"last good checkpoint: {ckpt.directory}/{last}"
              if last is not None else "no checkpoint was saved")
      raise ValueError(f"loss is {loss} at step {window * B} (window "
                       f"{window}); run stopped, {kept}")
    return loss

  def save(window):
    if not bool(all_finite(state.ring.params)):
      raise ValueError(f"weights are not finite after step {window * B} "
                       f"(window {window}); run stopped, last good "
                       f"checkpoint: {ckpt.directory}/{ckpt.latest_step()}")
    ckpt.save(window, state, {"window": window}, config_dict)

  # Loop. Window w (1-based) runs the rows of input window w - 1; metrics of
  # a window are read one window later, so the host never stalls the device.
  start, start_window, pending, preempted = None, first, None, None
  losses = [r["loss"] for r in writer.records if "loss" in r]
  loss = losses[-1] if losses else float("nan")
  window = first
  for window in range(first + 1, num_windows + 1):
    state, step_metrics = pipe.step(state, *batch(window - 1))
    if start is None:  # time the steady state, after compilation
      jax.block_until_ready(step_metrics)
      start, start_window = time.time(), window
      console.start(window * B)
    if pending is not None:
      loss = check(*pending)
    pending = (window, step_metrics)
    if window % config.log_every == 0 or window == num_windows:
      loss = check(*pending)
      rate = (window - start_window) * B / max(time.time() - start, 1e-9)
      # Whatever else the executor measures (e.g. num_losses) goes too.
      record = {k: float(v) for k, v in step_metrics.items()
                if np.ndim(v) == 0}
      seen = observed[:, (window - 1) * B:window * B]
      record.update(loss=loss, steps_per_s=rate,
                    examples_per_s=rate * examples_per_step, **static,
                    staleness_mean=float(seen.mean()),
                    staleness_max=float(seen.max()),
                    state_bytes=metrics_lib.tree_bytes(state),
                    **metrics_lib.memory_bytes())
      if config.eval_every and window % config.eval_every == 0:
        record["test_loss"], record["test_accuracy"] = evaluate(
            model_fn, pipe.params(state), *test, loss_fn)
        console.print(f"step {window * B}/{num_windows * B}  test loss "
                      f"{record['test_loss']:.4f}  test accuracy "
                      f"{record['test_accuracy']:.2%}")
      writer.write(window * B, record)
      console.show(window * B, loss)
    if preemption.requested():
      check(*pending)
      save(window)
      preempted = preemption.signal_name or "SIGTERM"
      break
    if config.checkpoint_every and window % config.checkpoint_every == 0:
      check(*pending)
      save(window)
  else:
    if pending is not None:
      loss = check(*pending)
    if ckpt.latest_step() != num_windows:
      save(num_windows)
  ckpt.wait()
  console.close()
  done = window if preempted else num_windows
  elapsed = time.time() - start if start is not None else 0.0
  if start is not None and done > start_window:
    steps_per_s = (done - start_window) * B / elapsed
  else:  # nothing left to train: the last logged figure of the run
    rates = [r["steps_per_s"] for r in writer.records if "steps_per_s" in r]
    steps_per_s = rates[-1] if rates else 0.0
  if preempted:
    return {"preempted": preempted, "steps": done * B, "final_loss": loss,
            "checkpoint": f"{ckpt.directory}/{done}"}

  # Evaluation, summary and plots. A signal now waits for them to finish.
  params = pipe.params(state)
  test_loss, accuracy = evaluate(model_fn, params, *test, loss_fn)
  summary = {"final_loss": loss, "test_loss": test_loss,
             "test_accuracy": accuracy, "steps": num_windows * B,
             "resumed_from_step": first * B if resumed else None,
             "skipped_checkpoints": ckpt.skipped,
             "steps_per_s": steps_per_s,
             "examples_per_s": steps_per_s * examples_per_step,
             "seconds": elapsed, **static,
             "state_bytes": metrics_lib.tree_bytes(state),
             **metrics_lib.memory_bytes(), "device": str(jax.devices()[0]),
             "num_devices": jax.device_count(),
             "num_processes": jax.process_count()}
  writer.write(num_windows * B, {"test_loss": test_loss,
                                 "test_accuracy": accuracy})
  if is_writer:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(os.path.join(workdir, "params.npz"),
             **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
    if config.plots:
      title = f"{config.schedule} / {config.model} / {config.dataset}"
      metrics_lib.plot_losses(writer.records,
                              os.path.join(workdir, "loss.png"), title)
      metrics_lib.plot_schedule(schedule, os.path.join(workdir, "schedule.png"),
                                f"{config.schedule}: S={S}, M={M}, B={B}")
    # Written last and atomically: its presence means the run is complete.
    tmp = os.path.join(workdir, "summary.json.tmp")
    with open(tmp, "w") as f:
      json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(workdir, "summary.json"))
  if preemption.signum is not None:
    summary["signal_after_training"] = preemption.signal_name
  return summary
