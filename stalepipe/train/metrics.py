"""Metrics out of a run: JSON lines, TensorBoard events, a progress bar, plots.

Only process 0 writes (big_vision's habit); the others get a writer that
drops everything. The console shows one live progress line (rich: it is
already a dependency of flax, and its console knows whether stderr is a
terminal) with evaluation lines printed above it. Files in the workdir:

- `metrics.jsonl`: one `{"step": ..., **metrics}` object per line;
- `tb/`: TensorBoard event files with the same scalars;
- `loss.png`: training loss and test accuracy against the step;
- `schedule.png`: a Gantt chart of the schedule of one window.
"""

import datetime
import json
import math
import os
import platform
import resource
import time
from typing import Any

import jax
import matplotlib
import numpy as np
from rich import console as rich_console
from rich import progress as rich_progress

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from stalepipe.schedules import render  # pylint: disable=g-import-not-at-top


class _TensorBoard:
  """TensorBoard scalars written in the caller's thread.

  tensorboardX's `SummaryWriter` writes from a thread of its own: when a
  write fails (a full disk) that thread dies and the next writes block
  forever on its queue. Here a failed write raises `OSError` where the run
  can report it. On resume, `purge_step` hides the events logged after the
  checkpoint, as `SummaryWriter(purge_step=)` does.
  """

  def __init__(self, logdir: str, purge_step: int | None):
    # pylint: disable=g-import-not-at-top
    from tensorboardX import event_file_writer
    from tensorboardX.proto import event_pb2
    from tensorboardX.proto import summary_pb2
    # pylint: enable=g-import-not-at-top
    os.makedirs(logdir, exist_ok=True)
    self._logdir, self._event_pb2, self._summary_pb2 = (logdir, event_pb2,
                                                        summary_pb2)
    self._events = event_file_writer.EventsWriter(
        os.path.join(logdir, "events"))
    if purge_step is not None:
      self._events.write_event(event_pb2.Event(
          step=purge_step, session_log=event_pb2.SessionLog(
              status=event_pb2.SessionLog.START)))
    self._events.flush()

  def add_scalars(self, step: int, metrics: dict[str, float]) -> None:
    try:
      for key, value in metrics.items():
        # The proto itself: tensorboardX's `summary.scalar` prints a warning
        # for a NaN, which the run reports in its own line.
        scalar = self._summary_pb2.Summary.Value(tag=key,
                                                  simple_value=float(value))
        self._events.write_event(self._event_pb2.Event(
            wall_time=time.time(), step=step,
            summary=self._summary_pb2.Summary(value=[scalar])))
      self._events.flush()
    except OSError as e:  # name the file (a full disk, say)
      raise OSError(e.errno, e.strerror, self._logdir) from e

  def close(self) -> None:
    self._events.close()


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
  """`record` with NaN and infinite floats as null: strict JSON (a reader
  such as `jq` or JavaScript's `JSON.parse` refuses Python's `NaN` token)."""
  return {k: None if isinstance(v, float) and not math.isfinite(v) else v
          for k, v in record.items()}


def _read_records(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl. A last line cut short (a kill while it
  was being appended) is dropped; any other line that is not a JSON record
  is one line naming the file and the line."""
  with open(path) as f:
    lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
  records = []
  for k, (i, line) in enumerate(lines):
    try:
      record = json.loads(line)
      if not isinstance(record, dict) or "step" not in record:
        raise ValueError("not a record with a step")
    except ValueError as e:
      if k == len(lines) - 1 and not line.endswith("\n"):
        break
      raise ValueError(f"{path} line {i} is not a metrics record ({e}); "
                       "valid: one JSON object with a step a line; move the "
                       "file aside, or --fresh") from None
    records.append(record)
  return records


class Writer:
  """Writes scalars to `metrics.jsonl` and TensorBoard under `workdir`.

  Args:
    workdir: the run's directory.
    enabled: False on processes other than 0: nothing is written.
    resume_step: for a resumed run, the step of its checkpoint: the records
      up to it are kept, later ones (written after that checkpoint, before
      the stop) dropped, and so is an evaluation at that step (the resumed
      run evaluates there again where one is due: `hooks.Evaluate.resumed`).
      None starts anew.
  """

  def __init__(self, workdir: str, enabled: bool, resume_step: int | None):
    self.enabled = enabled
    self.records: list[dict[str, Any]] = []
    if not enabled:
      return
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
      self.records = [r for r in _read_records(path)
                      if r["step"] < resume_step or
                      (r["step"] == resume_step and "test_loss" not in r)]
    # The kept records replace the file whole (a kill leaves the old file or
    # the new one), then new ones are appended and flushed one by one.
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(record) + "\n" for record in self.records)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    self._jsonl = open(path, "a")
    self._tb = _TensorBoard(os.path.join(workdir, "tb"),
                            None if resume_step is None else resume_step + 1)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    """Appends `{"step": step, **metrics}` to the JSONL and TensorBoard."""
    if not self.enabled:
      return
    record = {"step": step, **metrics}
    self.records.append(record)
    try:
      self._jsonl.write(json.dumps(_json_safe(record)) + "\n")
      self._jsonl.flush()
    except OSError as e:  # name the file (a full disk, say)
      raise OSError(e.errno, e.strerror, self._jsonl.name) from e
    self._tb.add_scalars(step, metrics)

  def close(self) -> None:
    """Closes both files; a failure here (the disk that failed a write) is
    the write's to report, so it is not raised again over it."""
    if self.enabled:
      for f in (self._jsonl, self._tb):
        try:
          f.close()
        except OSError:
          pass


class Progress:
  """The run's console: one progress line, other lines printed above it.

  On a terminal, a rich progress bar with the step, loss, steps/s and ETA
  redraws in place. Elsewhere (CI logs, SLURM files) the same figures print
  as plain lines, one per tenth of the run and one at the end, with no
  carriage returns.

  Args:
    total: the step the run ends at.
    enabled: False on processes other than 0: nothing is shown.
    first: the step the run starts (or resumes) at.
    console: where to draw; default: a rich console on stderr.
  """

  def __init__(self, total: int, enabled: bool, first: int = 0,
               console: rich_console.Console | None = None):
    self.total, self.enabled = total, enabled
    self.console = console or rich_console.Console(stderr=True)
    self.live = enabled and self.console.is_terminal
    self._first, self._start, self._shown = first, None, first
    self._bar = rich_progress.Progress(
        rich_progress.BarColumn(), rich_progress.MofNCompleteColumn(),
        rich_progress.TextColumn("{task.fields[figures]}"),
        console=self.console, auto_refresh=False, disable=not self.live)
    self._task = self._bar.add_task("train", total=total, completed=first,
                                    figures="compiling")
    if self.live:
      self._bar.start()

  def start(self, done: int) -> None:
    """Starts the clock (after compilation) at step `done`."""
    self._first, self._start = done, time.time()

  def figures(self, done: int, loss: float | None) -> str:
    """'loss 0.1234  123.4 steps/s  ETA 0:00:05' at step `done` ('loss -'
    where no minibatch finished yet)."""
    text = "loss -" if loss is None else f"loss {loss:.4f}"
    if self._start is not None and done > self._first:
      rate = (done - self._first) / max(time.time() - self._start, 1e-9)
      eta = datetime.timedelta(seconds=round((self.total - done) / rate))
      text += f"  {rate:.1f} steps/s  ETA {eta}"
    return text

  def show(self, done: int, loss: float | None) -> None:
    """Moves the bar to step `done` with the latest training loss."""
    if not self.enabled:
      return
    figures = self.figures(done, loss)
    if self.live:
      self._bar.update(self._task, completed=done, figures=figures)
      self._bar.refresh()
      return
    tenth = max(self.total // 10, 1)
    if done // tenth > self._shown // tenth or done >= self.total:
      self._shown = done
      self.console.print(f"step {done}/{self.total}  {figures}",
                         highlight=False, soft_wrap=True)

  def print(self, line: str) -> None:
    """Prints `line` above the bar (on process 0 only)."""
    if self.enabled:
      self._bar.console.print(line, highlight=False, soft_wrap=True)

  def close(self) -> None:
    """Leaves the finished bar on screen; safe to call twice."""
    if self.live:
      self._bar.stop()
      self.live = False


def memory_bytes() -> dict[str, float]:
  """Peak memory: the first device's allocator where it reports one (GPU,
  TPU), and this process's peak resident set on the host."""
  out = {"host_peak_bytes": float(
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
  stats = jax.local_devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    out["device_peak_bytes"] = float(stats["peak_bytes_in_use"])
  return out


def host() -> dict[str, str]:
  """What computed the run: the CPU model and its vector extensions (Linux's
  `/proc/cpuinfo`; elsewhere `platform.processor()` and none), the machine,
  and the versions of Python, jax and jaxlib.

  Runs of one config and code on two hosts may differ in the last digits
  (XLA's CPU kernels follow the instruction set), and in a deep asynchronous
  pipeline such a difference grows with the steps; this tells a reader which
  records came from which host.
  """
  info = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  vector = [flag for flag in info.get("flags", "").split()
            if flag.startswith(("avx", "fma", "amx", "sse4"))]
  return {"cpu": info.get("model name", platform.processor()),
          "cpu_vector_extensions": " ".join(vector),
          "machine": platform.machine(),
          "python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jax.lib.__version__}


def tree_bytes(tree: Any) -> float:
  """Bytes of all the arrays of `tree`, over all their shards."""
  return float(sum(np.prod(x.shape) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree)))


def plot_losses(records: list[dict[str, Any]], path: str, title: str) -> None:
  """Training loss (log scale) and test accuracy against the step."""
  fig, ax = plt.subplots(figsize=(6, 3.5))
  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  if train:
    ax.plot(*zip(*train), color="C0", label="train loss")
    ax.set_yscale("log")
  ax.set_xlabel("step (minibatches)")
  ax.set_ylabel("train loss")
  test = [(r["step"], r["test_accuracy"]) for r in records
          if "test_accuracy" in r]
  if test:
    acc = ax.twinx()
    acc.plot(*zip(*test), color="C1", marker="o", label="test accuracy")
    acc.set_ylabel("test accuracy")
    acc.set_ylim(0, 1)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_schedule(schedule, path: str, title: str) -> None:
  """The Gantt chart of the run's own schedule (one window)."""
  render.gantt_png(render.schedule_events(schedule), path, title=title)
