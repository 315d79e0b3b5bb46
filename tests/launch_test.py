"""The launcher end to end, and its one-line errors on bad input."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _launch(*args, workdir):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the launcher sets up its own devices
  return subprocess.run(
      [sys.executable, "launch.py", f"--workdir={workdir}", *args], cwd=ROOT,
      env=env, capture_output=True, text=True, timeout=300)


def test_default_launch_trains_to_90_percent(tmp_path):
  result = _launch(workdir=tmp_path, )
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["test_accuracy"] >= 0.9
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(line)["step"] for line in lines]
  assert steps == sorted(steps) and steps[-1] == summary["steps"]
  assert json.loads((tmp_path / "config.json").read_text())["schedule"] == "gpipe"
  assert "test accuracy" in result.stdout
  assert summary["seconds"] < 60
  for name in ("loss.png", "schedule.png", "params.npz"):
    assert (tmp_path / name).stat().st_size > 0, name
  assert any("tfevents" in p.name for p in (tmp_path / "tb").iterdir())
  assert str(summary["steps"] // 4) in os.listdir(tmp_path / "checkpoints")


@pytest.mark.parametrize("args,expected", [
    (["--config.no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--config.num_replicas=4"], "4 x 4 = 16 devices does not fit the 8"),
    (["--config.num_stages=6", "--config.num_replicas=1"],
     "num_stages=6 does not fit a model of 4 blocks; valid: 1 to 4"),
    (["--config.minibatches_per_window=3"],
     "num_steps=4 is not a multiple of minibatches_per_window=3"),
])
def test_bad_input_exits_with_one_line(tmp_path, args, expected):
  result = _launch(*args, "--config.num_steps=4", workdir=tmp_path)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error:") and expected in last, last


@pytest.mark.slow
def test_nan_loss_exits_with_one_line_naming_the_step(tmp_path):
  result = _launch("--config.optimizer=sgd",
                   "--config.optimizer_kwargs.learning_rate=3",
                   "--config.num_steps=400", "--config.checkpoint_every=1",
                   "--config.log_every=100", workdir=tmp_path)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error: loss is ") and " at step " in last
  assert "last good checkpoint: " in last, last


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_the_rerun_resumes(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  args = [sys.executable, "launch.py", f"--workdir={tmp_path}",
          "--config.num_steps=800", "--config.log_every=1",
          "--config.eval_every=0"]
  proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = tmp_path / "metrics.jsonl"
  while not (metrics.exists() and metrics.stat().st_size):
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith("launch.py: stopped by SIGTERM at step "), last
  stopped_at = int(last.split(" at step ")[1].split(";")[0])
  assert 0 < stopped_at < 800
  rerun = _launch("--config.num_steps=800", "--config.eval_every=0",
                  workdir=tmp_path)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["resumed_from_step"] == stopped_at
