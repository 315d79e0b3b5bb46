"""The training loop: one short function over one run state, with hooks.

After levanter's `Trainer` and the Flax examples' `train.py`: the loop steps
the pipeline one window (B minibatches, B steps) at a time and, after each,
calls every hook that is due. Logging, evaluation, checkpoints, preemption,
the NaN stop, throughput and profiling are hooks (`stalepipe.train.hooks`);
a user adds one without copying the loop.

A hook is any callable `hook(run: Run) -> None` with an `every` attribute in
steps (minibatches, the unit a user counts): it is due after the window in
which the step count reaches a multiple of `every` (0: never during the run).
It may also have `end(run)`, called once after the last window. A hook
stops the run early by raising `Stop`. Example, outside `stalepipe/`:

.. code-block:: python

  class StageGradNorms:
    every = 100

    def __call__(self, run):
      print(run.step, float(run.metrics["loss"]))

  loop.run(parts.pipeline.step, loop.Run(0, state, {}), parts.batch,
           num_steps=800, steps_per_window=4, hooks=[StageGradNorms()])
"""

import time
from typing import Any, Callable, NamedTuple, Sequence


class Run(NamedTuple):
  """What the loop carries from one window to the next."""

  step: int  # minibatches trained so far
  state: Any  # the pipeline's state
  metrics: dict[str, Any]  # the last window's step metrics (device values)


class Stop(Exception):
  """Raised by a hook to end the run after the current window."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def due(every: int, step: int, steps_per_window: int) -> bool:
  """Whether a window ending at `step` crossed a multiple of `every`.

  Examples:
    >>> [s for s in range(4, 41, 4) if due(10, s, 4)]
    [12, 20, 32, 40]
  """
  return bool(every) and step // every > (step - steps_per_window) // every


def run(step_fn: Callable[..., tuple[Any, dict[str, Any]]], start: Run,
        batch: Callable[[int], tuple[Any, ...]], num_steps: int,
        steps_per_window: int, hooks: Sequence[Any] = ()) -> tuple[Run, str]:
  """Steps from `start.step` to `num_steps`, calling the hooks that are due.

  Args:
    step_fn: `(state, *batch) -> (state, metrics)`, e.g. `Pipeline.step`.
    start: the run state to continue from (step 0 for a fresh run).
    batch: window index -> the window's arrays.
    num_steps: steps (minibatches) to train to, a multiple of
      `steps_per_window`.
    steps_per_window: B, minibatches per call of `step_fn`.
    hooks: called in order after each window where due, then `end`.

  Returns:
    The last run state, and why it stopped: "done" or a `Stop`'s reason.
  """
  current, why = start, "done"
  try:
    while current.step < num_steps:
      state, metrics = step_fn(current.state,
                               *batch(current.step // steps_per_window))
      current = Run(current.step + steps_per_window, state, metrics)
      for hook in hooks:
        if due(hook.every, current.step, steps_per_window):
          hook(current)
  except Stop as stop:
    why = stop.reason
  for hook in hooks:
    if hasattr(hook, "end"):
      hook.end(current)
  return current, why


class Timer:
  """Seconds spent in hooks that are not training (evaluation, saves).

  `Timed(hook, timer)` adds a hook's time here, so a throughput hook can
  leave it out.
  """

  def __init__(self):
    self.seconds = 0.0


class Timed:
  """`hook`, with the seconds it takes added to `timer`."""

  def __init__(self, hook: Any, timer: Timer):
    self.hook, self.timer, self.every = hook, timer, hook.every

  def _timed(self, fn, current: Run) -> None:
    start = time.perf_counter()
    try:
      fn(current)
    finally:
      self.timer.seconds += time.perf_counter() - start

  def __call__(self, current: Run) -> None:
    self._timed(self.hook, current)

  def end(self, current: Run) -> None:
    if hasattr(self.hook, "end"):
      self._timed(self.hook.end, current)
