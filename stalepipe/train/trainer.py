"""Turns a config into a run: build the parts, restore, loop with hooks.

After big_vision's `train.py` and levanter's `train_lm.py`. A run writes into
its workdir, which it holds locked (`workdir.lock`) while it runs:

- `config.json`, `metrics.jsonl`, `tb/` (TensorBoard), `summary.json`,
  `loss.png`, `schedule.png`, `params.npz` (the final weights);
- `checkpoints/<step>/`: the whole pipeline state and the trainer's
  position. A run started on a workdir that holds a checkpoint resumes from
  it and ends with exactly the parameters of the uninterrupted run, and its
  `metrics.jsonl` with that run's evaluations (the one due at the step it
  resumes from is taken again: `hooks.Evaluate.resumed`).

Evaluation runs through the mesh (`Pipeline.evaluate`, `hooks.evaluate`).
A run that reaches `num_steps` drains its pipeline (`Pipeline.drain`: the
minibatches an asynchronous schedule still has in flight finish), then
evaluates and writes `params.npz` from the drained weights; its last
checkpoint holds the state before the drain, so a larger `num_steps`
continues it as if it had never stopped (its evaluation at the old end is
then taken again, of the undrained state, as the longer run takes it).

The config is checked whole by building its parts (`build.parts`) before
anything is written. Intervals (`log_every`, `eval_every`,
`checkpoint_every`) count steps, i.e. minibatches; each is honoured at the
end of the window (`minibatches_per_window` steps) that reaches it. SIGTERM
or SIGINT stops the run after the current window with a checkpoint; a NaN or
inf loss stops it, naming the step, without saving the broken state (the
last good checkpoint stays). A failure closes the checkpoint manager and the
writers on its way out, so the process always ends.
"""

import json
import os
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from stalepipe import sync as sync_lib
from stalepipe.train import build
from stalepipe.train import checkpoint as checkpoint_lib
from stalepipe.train import hooks as hooks_lib
from stalepipe.train import loop
from stalepipe.train import metrics as metrics_lib
from stalepipe.train import preemption as preemption_lib
from stalepipe.train import workdir as workdir_lib

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       hooks: Sequence[Any] = ()) -> dict[str, Any]:
  """Builds `config`'s parts and trains them in `workdir` (`train`)."""
  return train(build.parts(config), workdir, hooks)


def train(parts: build.Parts, workdir: str, hooks: Sequence[Any] = (),
          fresh: bool = False) -> dict[str, Any]:
  """Trains `parts` in `workdir`, resuming from its latest checkpoint.

  A workdir whose run already ended at `config.num_steps` (its summary and
  final checkpoint written) is left as it is and its summary returned, with
  `already_finished` set.

  Args:
    parts: the run's parts, from `build.parts(config)`.
    workdir: where the run writes; held locked while it runs.
    hooks: more hooks (`stalepipe.train.loop`), run after the trainer's own
      and the config's (`config.hooks`).
    fresh: start afresh: whatever an earlier run left in `workdir` is moved
      to `<workdir>/previous-N/` first (nothing is deleted).

  Returns:
    The summary: final evaluation (on the drained weights), what the drain
    did, steps (minibatches), training throughput (without evaluation and
    checkpoints), and `preempted` (the signal's name) if a signal stopped
    the run (not drained).

  Raises:
    ValueError: on a workdir another run holds, one that holds a run's
      results but no checkpoint to resume (unless `fresh`), no checkpoint
      that verifies,
      a foreign checkpoint, `num_steps` below the checkpoint's step, or a
      NaN/inf loss (naming the step; the drain's too).
    checkpoint_lib.CheckpointError: if a checkpoint cannot be written.
  """
  with workdir_lib.lock(workdir), preemption_lib.Preemption() as preemption:
    if fresh and jax.process_index() == 0:
      workdir_lib.move_aside(workdir)
    return _train(parts, workdir, preemption, hooks)


def _write_atomically(path: str, text: str) -> None:
  """Writes `text` to a temporary file and renames it to `path`."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def _finished_summary(workdir: str, num_steps: int) -> dict[str, Any] | None:
  """The summary of a run in `workdir` that already ended: at `num_steps`,
  or early (a hook's `loop.Stop`)."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  ended = summary.get("steps") == num_steps or summary.get("stopped_early")
  return summary if ended else None


def _configured_hooks(parts: build.Parts, workdir: str) -> list[Any]:
  """The config's own hooks, each `factory(parts, workdir, **kwargs)`; one
  line if a factory fails or returns no hook (a callable with `every`)."""
  hooks = []
  for i, (factory, kwargs) in enumerate(parts.hooks):
    name = getattr(factory, "__qualname__", repr(factory))
    try:
      hook = factory(parts, workdir, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"hooks[{i}] {name} failed: {type(e).__name__}: {e}"
                       ) from None
    if not callable(hook) or not hasattr(hook, "every"):
      raise ValueError(f"hooks[{i}] {name} returned {type(hook).__name__}; "
                       "valid: a hook, a callable with an `every` attribute "
                       "(stalepipe.train.loop)")
    hooks.append(hook)
  return hooks


def _check_finished_config(workdir: str, config_dict: dict[str, Any]) -> None:
  """One line if the finished run in `workdir` was trained with another
  config: its results must not stand in for this one's."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    saved = {}
  changed = checkpoint_lib.changed_fields(saved, config_dict)
  if changed:
    raise ValueError(f"the finished run in {workdir} was trained with another "
                     f"config (fields {', '.join(changed)} differ); valid: "
                     "the config it was run with, --fresh, or a new --workdir")


def _restore(parts: build.Parts, ckpt, config_dict, console) -> tuple[Any, int]:
  """The newest checkpoint's state and step, or a fresh state at step 0."""
  config, B = parts.config, parts.steps_per_window
  restored = None
  source = _reshard_source(parts, ckpt, config_dict)
  if source is not None:  # saved on another 'fsdp' size: restored there
    restored = ckpt.restore(source.pipeline.abstract_state(
        source.staged.stage_params, *source.batch(0)),
                            json.loads(source.config.to_json()))
    if restored is not None:
      parts.pipeline.init(parts.staged.stage_params)  # its layouts
      restored = (parts.pipeline.reshard(restored[0], source.pipeline),
                  restored[1])
      console.print(f"resharded the checkpoint from fsdp="
                    f"{source.config.fsdp} to fsdp={config.get('fsdp', 1)}")
  elif ckpt.latest_step() is not None:
    restored = ckpt.restore(parts.pipeline.abstract_state(
        parts.staged.stage_params, *parts.batch(0)), config_dict)
  for line in ckpt.skipped:
    console.print(f"skipped checkpoint {line}")
  if restored is None:
    workdir = os.path.dirname(ckpt.directory)
    aside = workdir_lib.check_no_results(workdir)
    if aside:
      console.print(f"the earlier run in {workdir} saved no checkpoint and no "
                    f"results; its records moved to {aside}")
    return parts.pipeline.init(parts.staged.stage_params), 0
  state, position = restored
  # Checkpoints name their step; those of older runs named their window.
  step = position["step"] if "step" in position else position["window"] * B
  where = f"{ckpt.directory}/{ckpt.restored_from}"
  if step > config.num_steps:
    raise ValueError(f"num_steps={config.num_steps} is below step {step} of "
                     f"checkpoint {where}; valid: num_steps >= {step} to "
                     "continue it, or a new --workdir")
  console.print(f"resuming from checkpoint {where} (step {step})")
  return state, step


def _reshard_source(parts: build.Parts, ckpt, config_dict) -> Any:
  """The run's parts as the newest checkpoint was written (`build.Parts`),
  where it differs from this config only in `fsdp`; else None. Its mesh
  must fit the devices here too."""
  saved = ckpt.saved_config()
  changed = checkpoint_lib.changed_fields(saved, config_dict)
  if changed != ["fsdp"]:
    return None
  config = ml_collections.ConfigDict(parts.config.to_dict())
  config.fsdp = saved.get("fsdp", 1)
  return build.parts(config)


def _train(parts: build.Parts, workdir: str,
           preemption: preemption_lib.Preemption,
           user_hooks: Sequence[Any]) -> dict[str, Any]:
  """`train` with the lock and the signal handler in place."""
  config, pipe = parts.config, parts.pipeline
  config_dict = json.loads(config.to_json())
  is_writer = jax.process_index() == 0
  B, num_steps = parts.steps_per_window, config.num_steps
  finished = _finished_summary(workdir, num_steps)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     keep=config.keep_checkpoints)
  console = metrics_lib.Progress(num_steps, is_writer)
  writer = None
  try:
    if finished is not None and ckpt.latest_step() in (finished["steps"],
                                                       finished["steps"] // B):
      _check_finished_config(workdir, config_dict)
      return dict(finished, already_finished=True)
    state, first = _restore(parts, ckpt, config_dict, console)
    if pipe.replicated_leaves:
      console.print("held whole by every fsdp device (no dimension divisible "
                    f"by fsdp={pipe.fsdp}): "
                    + ", ".join(pipe.replicated_leaves))
    configured = _configured_hooks(parts, workdir)  # before anything is written
    if is_writer:  # whole or not at all, as every file the run writes
      _write_atomically(os.path.join(workdir, "config.json"),
                        config.to_json(indent=2))
    writer = metrics_lib.Writer(workdir, is_writer,
                                resume_step=first if first else None)
    hooks, throughput, evaluation = _hooks(parts, config_dict, ckpt, writer,
                                           console, preemption)
    if first:
      evaluation.resumed(loop.Run(first, state, {}), B)
    end, why = loop.run(pipe.step, loop.Run(first, state, {}), parts.batch,
                        num_steps, B, [*hooks, *configured, *user_hooks])
    ckpt.wait()
    console.close()
    if why != "done" and preemption.requested():
      return {"preempted": why, "steps": end.step,
              "checkpoint": f"{ckpt.directory}/{end.step}"}
    # A hook's `loop.Stop` (an early stop) ends the run as `num_steps` does.
    end, drained = _drain(pipe, end, ckpt)
    return _summary(parts, workdir, end, first, ckpt, writer, throughput,
                    evaluation, preemption,
                    dict(drained, stopped_early=None if why == "done"
                         else why))
  finally:  # whatever happened: pending saves end, threads and files close
    console.close()
    try:
      ckpt.wait()
    finally:
      ckpt.close()
      if writer is not None:
        writer.close()


def _drain(pipe, end: loop.Run, ckpt) -> tuple[loop.Run, dict[str, Any]]:
  """The run's end with the minibatches still in flight finished
  (`Pipeline.drain`; its checkpoint, saved and waited for, keeps the state
  before), and what the drain did: the minibatches it finished (the most
  updates it applied to a stage) and the mean loss of the forwards it ran
  (None where it ran none)."""
  def latest(state):  # updates applied per stage, [D, S]
    return pipe.updates_applied(state)

  before = latest(end.state)
  state, metrics = pipe.drain(end.state)  # donates the state it drains
  n = int(metrics["num_losses"])
  loss = float(metrics["loss"]) if n else None
  if ((loss is not None and not np.isfinite(loss))
      or not bool(hooks_lib.all_finite([r.params for r in state.ring]))):
    raise ValueError(f"loss {loss} or weights not finite in the drain after "
                     f"step {end.step}; run stopped, last good checkpoint: "
                     f"{ckpt.directory}/{ckpt.latest_step()}")
  return end._replace(state=state), {
      "drained_minibatches": int((latest(state) - before).max()),
      "drained_loss": loss, "drained_num_losses": n}


def _hooks(parts, config_dict, ckpt, writer, console, preemption):
  """The trainer's own hooks, in the order they run after a window; the
  throughput and evaluation hooks again, which the summary reads."""
  config, pipe, B = parts.config, parts.pipeline, parts.steps_per_window
  # [replicas, minibatches]: what each forward missed, sync policy included.
  observed = sync_lib.ObservedStaleness(parts.schedule, pipe.sync,
                                        config.num_steps)

  def last_checkpoint() -> str:
    ckpt.wait()
    last = ckpt.latest_step()
    return (f"last good checkpoint: {ckpt.directory}/{last}"
            if last is not None else "no checkpoint was saved")

  def save(run: loop.Run) -> None:
    nan_stop.check()  # a NaN loss is named as such, before the weights
    if not bool(hooks_lib.all_finite([r.params for r in run.state.ring])):
      raise ValueError(f"weights are not finite after step {run.step}; run "
                       f"stopped, {last_checkpoint()}")
    ckpt.save(run.step, run.state, {"step": run.step}, config_dict)

  def extra(run: loop.Run) -> dict[str, float]:
    seen = observed[:, run.step - B:run.step]
    rate = throughput.rate(run.step)
    return {"bubble": parts.schedule.bubble_fraction,
            "staleness_mean": float(seen.mean()),
            "staleness_max": float(seen.max()),
            **({} if rate is None else {
                "steps_per_s": rate,
                "examples_per_s": rate * parts.examples_per_step}),
            "state_bytes": metrics_lib.tree_bytes(run.state),
            **metrics_lib.memory_bytes()}

  def evaluate(state) -> tuple[float, float]:
    return hooks_lib.evaluate(pipe, state, *parts.test, parts.loss_fn,
                              parts.window_shape)

  timer = loop.Timer()
  throughput = hooks_lib.Throughput(B, timer, on_start=console.start)
  nan_stop = hooks_lib.NanStop(B, last_checkpoint)
  evaluation = hooks_lib.Evaluate(config.eval_every, config.num_steps,
                                  evaluate, writer, console)
  hooks = [
      throughput,
      nan_stop,
      hooks_lib.Log(config.log_every, writer, console, extra),
      loop.Timed(evaluation, timer),
      loop.Timed(hooks_lib.Checkpoint(config.checkpoint_every, save,
                                      ckpt.latest_step), timer),
      hooks_lib.Preempt(B, preemption, save),
  ]
  return hooks, throughput, evaluation


def _summary(parts, workdir, end, first, ckpt, writer, throughput,
             evaluation, preemption, drained) -> dict[str, Any]:
  """The final evaluation, summary.json, weights and plots, of the drained
  state `end.state`; `drained`: what the drain did (`_drain`)."""
  config, pipe = parts.config, parts.pipeline
  test_loss, accuracy = evaluation.final(end)
  losses_seen = [r["loss"] for r in writer.records if "loss" in r]
  rate = throughput.steps_per_s
  if rate is None:  # nothing left to train: the last logged figure
    rates = [r["steps_per_s"] for r in writer.records if "steps_per_s" in r]
    rate = rates[-1] if rates else 0.0
  summary = {
      "test_loss": test_loss, "test_accuracy": accuracy,
      "final_training_loss": losses_seen[-1] if losses_seen else None,
      "steps": end.step, **drained, "resumed_from_step": first or None,
      "skipped_checkpoints": ckpt.skipped,
      # Training only: from the end of the first (compiling) window to the
      # last, without evaluation and checkpoints.
      "steps_per_s": rate, "examples_per_s": rate * parts.examples_per_step,
      "seconds": throughput.seconds,
      "bubble": parts.schedule.bubble_fraction,
      "state_bytes": metrics_lib.tree_bytes(end.state),
      **metrics_lib.memory_bytes(), "device": str(jax.devices()[0]),
      "host": metrics_lib.host(),
      "num_devices": jax.device_count(),
      "num_processes": jax.process_count()}
  params = pipe.params(end.state)  # collective: every process takes part
  if jax.process_index() == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    path = os.path.join(workdir, "params.npz")
    with open(path + ".tmp", "wb") as f:
      np.savez(f, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
    os.replace(path + ".tmp", path)
    if config.plots:
      title = f"{config.schedule} / {config.model} / {config.dataset}"
      metrics_lib.plot_losses(writer.records,
                              os.path.join(workdir, "loss.png"), title)
      metrics_lib.plot_schedule(
          parts.schedule, os.path.join(workdir, "schedule.png"),
          f"{config.schedule}: S={config.num_stages}, "
          f"M={config.num_microbatches}, B={parts.steps_per_window}")
    # Written last and atomically: its presence means the run is complete.
    _write_atomically(os.path.join(workdir, "summary.json"),
                      json.dumps(summary, indent=2))
  if preemption.signum is not None:
    summary["signal_after_training"] = preemption.signal_name
  return summary
