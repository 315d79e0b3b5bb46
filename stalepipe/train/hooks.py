"""The trainer's hooks: NaN stop, logging, evaluation, checkpoints,
preemption, throughput and profiling, each run `every` N steps.

Each is a small class with `every` (steps) and `__call__(run)`, some with
`end(run)`; `stalepipe.train.loop` says when they run. Metrics are device
values until a hook reads them, so a hook that reads only every N steps
leaves the host free to queue the next window.
"""

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.train import loop

_EVAL_BATCH = 512


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


def training_loss(metrics: dict[str, Any]) -> float | None:
  """The window's mean training loss; None where no minibatch finished
  (the first windows of a deep asynchronous pipeline)."""
  if "num_losses" in metrics and int(metrics["num_losses"]) == 0:
    return None
  return float(metrics["loss"])


class NanStop:
  """Stops the run, naming the step, at the first NaN or inf loss.

  It reads each window's loss one window late, so the host never waits on
  the window it has just queued; `end` reads the last. The broken state is
  never saved (the checkpoint hook checks the weights as well).
  """

  def __init__(self, steps_per_window: int, last_checkpoint: Callable[[], str]):
    self.every = steps_per_window
    self._last_checkpoint = last_checkpoint
    self._pending = None

  def check(self) -> None:
    """Checks the window handed over last (before a save, say)."""
    if self._pending is None:
      return
    step, metrics = self._pending
    loss = training_loss(metrics)
    if loss is not None and not np.isfinite(loss):
      raise ValueError(f"loss is {loss} at step {step}; run stopped, "
                       f"{self._last_checkpoint()}")

  def __call__(self, run: loop.Run) -> None:
    self.check()
    self._pending = (run.step, run.metrics)

  def end(self, run: loop.Run) -> None:
    del run  # every window was handed to __call__
    self.check()


class Log:
  """One record per `every` steps (and the last) to metrics.jsonl, TensorBoard
  and the console: the training loss when a minibatch finished in the
  window, the step metrics, staleness, memory."""

  def __init__(self, every: int, writer, console,
               extra: Callable[[loop.Run], dict[str, float]]):
    self.every = every
    self._writer, self._console, self._extra = writer, console, extra
    self._logged = None

  def __call__(self, run: loop.Run) -> None:
    record = {k: float(v) for k, v in run.metrics.items()
              if np.ndim(v) == 0 and k != "loss"}
    loss = training_loss(run.metrics)
    if loss is not None:
      record["loss"] = loss
    record.update(self._extra(run))
    self._writer.write(run.step, record)
    self._console.show(run.step, loss)
    self._logged = run.step

  def end(self, run: loop.Run) -> None:
    if run.metrics and self._logged != run.step:
      self(run)


class Evaluate:
  """Test loss and accuracy every `every` steps (a record of its own)."""

  def __init__(self, every: int, num_steps: int, evaluate_fn, writer, console):
    self.every, self._num_steps = every, num_steps
    self._evaluate, self._writer, self._console = evaluate_fn, writer, console

    self._last = None  # (step, test loss, accuracy)

  def __call__(self, run: loop.Run) -> None:
    test_loss, accuracy = self.at(run)
    self._console.print(f"step {run.step}/{self._num_steps}  test loss "
                        f"{test_loss:.4f}  test accuracy {accuracy:.2%}")

  def at(self, run: loop.Run) -> tuple[float, float]:
    """Test loss and accuracy at `run.step` (once per step), recorded."""
    if self._last is None or self._last[0] != run.step:
      test_loss, accuracy = self._evaluate(run.state)
      self._writer.write(run.step, {"test_loss": test_loss,
                                    "test_accuracy": accuracy})
      self._last = (run.step, test_loss, accuracy)
    return self._last[1:]


class Checkpoint:
  """Saves the state every `every` steps, and at the end of the run."""

  def __init__(self, every: int, save: Callable[[loop.Run], None],
               latest: Callable[[], int | None]):
    self.every, self._save, self._latest = every, save, latest

  def __call__(self, run: loop.Run) -> None:
    self._save(run)

  def end(self, run: loop.Run) -> None:
    if run.metrics and self._latest() != run.step:
      self._save(run)


class Preempt:
  """After a SIGTERM or SIGINT: save and stop (each window)."""

  def __init__(self, steps_per_window: int, preemption,
               save: Callable[[loop.Run], None]):
    self.every, self._preemption, self._save = (steps_per_window, preemption,
                                                save)

  def __call__(self, run: loop.Run) -> None:
    if self._preemption.requested():
      self._save(run)
      raise loop.Stop(self._preemption.signal_name or "SIGTERM")


class Throughput:
  """Training steps per second from the end of the first window (compiled)
  to the last, without the seconds spent in evaluation and checkpoints."""

  def __init__(self, steps_per_window: int, timer: loop.Timer,
               on_start: Callable[[int], None] = lambda step: None):
    self.every, self._timer, self._on_start = steps_per_window, timer, on_start
    self._start = None  # (step, time, seconds not training so far)
    self.steps_per_s, self.seconds = None, 0.0

  def __call__(self, run: loop.Run) -> None:
    if self._start is None:
      jax.block_until_ready(run.metrics)
      self._start = (run.step, time.perf_counter(), self._timer.seconds)
      self._on_start(run.step)

  def _training_seconds(self) -> float:
    """Seconds since the first window ended, less those not training."""
    _, start, not_training = self._start
    return (time.perf_counter() - start
            - (self._timer.seconds - not_training))

  def end(self, run: loop.Run) -> None:
    if self._start is None or run.step == self._start[0]:
      return
    jax.block_until_ready(run.state)
    self.seconds = self._training_seconds()
    self.steps_per_s = (run.step - self._start[0]) / max(self.seconds, 1e-9)

  def rate(self, step: int) -> float | None:
    """Steps per second up to `step` (None before the second window)."""
    if self._start is None or step <= self._start[0]:
      return None
    return (step - self._start[0]) / max(self._training_seconds(), 1e-9)


class Profile:
  """A `jax.profiler` trace of steps [start, start + num_steps) into `logdir`
  (view it in TensorBoard or Perfetto)."""

  def __init__(self, steps_per_window: int, start: int, num_steps: int,
               logdir: str):
    self.every = steps_per_window
    self._start, self._stop, self._logdir = start, start + num_steps, logdir
    self._tracing = False

  def __call__(self, run: loop.Run) -> None:
    if not self._tracing and self._start <= run.step < self._stop:
      jax.profiler.start_trace(self._logdir)
      self._tracing = True
    elif self._tracing and run.step >= self._stop:
      self.end(run)

  def end(self, run: loop.Run) -> None:
    if self._tracing:
      jax.block_until_ready(run.state)
      jax.profiler.stop_trace()
      self._tracing = False
