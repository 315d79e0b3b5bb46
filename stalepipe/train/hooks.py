"""The trainer's hooks: NaN stop, logging, evaluation, checkpoints,
preemption, throughput and profiling, each run `every` N steps.

Each is a small class with `every` (steps) and `__call__(run)`, some with
`end(run)`; `stalepipe.train.loop` says when they run. Metrics are device
values until a hook reads them, so a hook that reads only every N steps
leaves the host free to queue the next window.
"""

import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import executor
from stalepipe.pipeline import stage as stage_lib
from stalepipe.train import loop

@jax.jit
def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf is finite (no NaN, no inf)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                            for x in jax.tree.leaves(tree)]))


def eval_rows(num_examples: int,
              window_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """The test set's rows in windows of the step's shape, and their weights.

  Rows `0 .. n-1` in order fill K windows `[B, M, D*b]`; the last is padded
  with rows from the start again (real examples, so the padding's outputs
  are finite), each of weight 0.

  Args:
    num_examples: n, the test set's size.
    window_shape: `[B, M, D, b]` (`build.Parts.window_shape`).

  Returns:
    Row indices `[K, B, M, D*b]` and weights `[K, B, M, D*b]` (1: a real
    example, 0: padding).

  Examples:
    >>> rows, weights = eval_rows(5, (1, 1, 2, 2))
    >>> rows.tolist()
    [[[[0, 1, 2, 3]]], [[[4, 0, 1, 2]]]]
    >>> weights.ravel().tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
  """
  B, M, D, b = window_shape
  per_window = B * M * D * b
  if num_examples < 1:
    raise ValueError(f"a test set of {num_examples} examples is invalid; "
                     "valid: at least 1")
  num_windows = -(-num_examples // per_window)
  index = np.arange(num_windows * per_window).reshape(
      (num_windows, B, M, D * b))
  return index % num_examples, (index < num_examples).astype(np.float32)


@functools.partial(jax.jit, static_argnums=0)
def _window_sums(loss_fn, outputs, targets, weights):
  """The loss and the correct labels summed over a window's real examples.

  Each example's loss is `loss_fn` of it alone, so their mean over the test
  set is `loss_fn`'s mean over it whatever the windows (every example has
  the same number of labels)."""
  def one(y, t):
    return loss_fn(y[None], t[None])

  losses = jax.vmap(jax.vmap(jax.vmap(one)))(outputs, targets)  # [B, M, D*b]
  correct = jnp.sum(jnp.argmax(outputs, -1) == targets,
                    axis=tuple(range(3, targets.ndim)))
  real = weights > 0
  return (jnp.sum(jnp.where(real, losses, 0.0)),
          jnp.sum(jnp.where(real, correct, 0)))


def evaluate(pipe, state, x: np.ndarray, y: np.ndarray, loss_fn,
             window_shape: Sequence[int]) -> tuple[float, float]:
  """Mean test loss and accuracy (per label: per token for a language model)
  through the mesh: `pipe.evaluate` on the latest weights of `state`, over
  the test set `(x, y)` cut into windows of the step's shape (`eval_rows`).

  The padding of the last window counts in neither figure, so both equal the
  unpipelined model's on the same weights. A collective: every process calls
  it with the whole test set and passes `pipe.evaluate` its own slice.
  """
  rows, weights = eval_rows(len(x), window_shape)
  sums = []
  for k in range(len(rows)):
    inputs, targets, real = pipe.place(executor.process_slice(
        (x[rows[k]], y[rows[k]], weights[k]), pipe.mesh))
    outputs = pipe.evaluate(state, inputs, targets)["outputs"]
    sums.append(_window_sums(loss_fn, outputs, targets, real))
  count = len(x)
  loss_sum, correct = (sum(float(s[i]) for s in sums) for i in range(2))
  return loss_sum / count, correct / (count * np.prod(y.shape[1:]))


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
    # A stage metric is NaN, like the loss, in a window where no minibatch
    # finished: left out, never written as NaN.
    record = {k: float(v) for k, v in run.metrics.items()
              if np.ndim(v) == 0 and k != "loss" and np.isfinite(float(v))}
    loss = training_loss(run.metrics)
    if loss is not None:
      record["loss"] = loss
    extra = self._extra(run)
    unknown = set(extra) - set(stage_lib.RESERVED)
    if unknown:  # a trainer figure a user's metric could overwrite
      raise RuntimeError(f"trainer records {sorted(unknown)} are not in "
                         "stalepipe.pipeline.stage.RECORD_NAMES; add them there")
    record.update(extra)
    self._writer.write(run.step, record)
    self._console.show(run.step, loss)
    self._logged = run.step

  def end(self, run: loop.Run) -> None:
    if run.metrics and self._logged != run.step:
      self(run)


class Evaluate:
  """Test loss and accuracy every `every` steps (a record of its own).

  The evaluation at `num_steps` is the trainer's, after the drain (`final`),
  so a run's last figures are those of the weights it writes.
  """

  def __init__(self, every: int, num_steps: int, evaluate_fn, writer, console):
    self.every, self._num_steps = every, num_steps
    self._evaluate, self._writer, self._console = evaluate_fn, writer, console

    self._last = None  # (step, test loss, accuracy)

  def __call__(self, run: loop.Run) -> None:
    if run.step < self._num_steps:
      self._show(run.step, *self.at(run))

  def resumed(self, run: loop.Run, steps_per_window: int) -> None:
    """At the step a run resumes from, the evaluation the uninterrupted run
    made there, when one was due (the resumed `metrics.Writer` dropped what
    the stopped run recorded at that step: the same figures after a
    SIGTERM, those of the drained weights where the run is extended past
    its old `num_steps`)."""
    if loop.due(self.every, run.step, steps_per_window):
      self(run)

  def final(self, run: loop.Run) -> tuple[float, float]:
    """Test loss and accuracy of the run's final (drained) state, shown; a
    mid-run evaluation at the same step (an early stop) is of other weights."""
    if self._last is not None and self._last[0] == run.step:
      self._last = None
    test_loss, accuracy = self.at(run)
    self._show(run.step, test_loss, accuracy)
    return test_loss, accuracy

  def _show(self, step: int, test_loss: float, accuracy: float) -> None:
    self._console.print(f"step {step}/{self._num_steps}  test loss "
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
