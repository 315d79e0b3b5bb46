"""The run's console: a live bar on a terminal, plain lines elsewhere."""

import io
import time

from rich import console as rich_console

from stalepipe.train import metrics


def _console(terminal):
  out = io.StringIO()
  return out, rich_console.Console(file=out, force_terminal=terminal,
                                   width=120)


def test_terminal_gets_one_redrawn_line_with_loss_rate_and_eta():
  out, console = _console(terminal=True)
  progress = metrics.Progress(800, enabled=True, console=console)
  progress.start(0)
  for done in range(8, 801, 8):
    time.sleep(0.001)
    progress.show(done, loss=1.0 / done)
  progress.print("step 400/800  test loss 0.0770  test accuracy 98.33%")
  progress.close()
  text = out.getvalue()
  assert "\r" in text or "\x1b[" in text  # redrawn in place
  assert "800/800" in text and "steps/s  ETA 0:00:00" in text
  assert "test accuracy 98.33%" in text
  # Redraws move the cursor; what stays is the evaluation and the final bar.
  final = text.rsplit("\x1b[2K", 1)[-1]
  assert "800/800" in final


def _piped(first):
  """A run from step `first` to 800, 4 steps a window, into a pipe."""
  out, console = _console(terminal=False)
  progress = metrics.Progress(800, enabled=True, first=first, console=console)
  progress.start(first)
  for done in range(first + 4, 801, 4):
    progress.show(done, loss=0.5)
  return out, progress


def test_pipe_gets_a_line_per_tenth_without_carriage_returns():
  out, progress = _piped(first=0)
  progress.print("step 800/800  test loss 0.0817  test accuracy 98.61%")
  progress.close()
  lines = out.getvalue().splitlines()
  assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
  assert [l.split()[1] for l in lines[:-1]] == [
      f"{s}/800" for s in range(80, 801, 80)]
  assert lines[-2].startswith("step 800/800  loss 0.5000  ")
  assert " steps/s  ETA 0:00:00" in lines[-2]


def test_a_resumed_run_counts_from_its_checkpoint():
  out, _ = _piped(first=400)
  lines = out.getvalue().splitlines()
  assert lines[0].startswith("step 480/800") and len(lines) == 5


def test_other_processes_show_nothing():
  out, console = _console(terminal=True)
  progress = metrics.Progress(10, enabled=False, console=console)
  progress.show(10, 0.1)
  progress.print("x")
  progress.close()
  assert out.getvalue() == ""
