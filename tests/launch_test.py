"""The launcher end to end, and its one-line errors on bad input."""

import json
import os
import pathlib
import subprocess
import sys

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


@pytest.mark.parametrize("args,expected", [
    (["--config.no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--config.num_replicas=4"], "4 x 4 = 16 devices does not fit the 8"),
    (["--config.num_stages=6", "--config.num_replicas=1"],
     "num_stages=6 does not fit the model's 4 blocks; valid: 1 to 4"),
])
def test_bad_input_exits_with_one_line(tmp_path, args, expected):
  result = _launch(*args, "--config.num_steps=4", workdir=tmp_path)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error:") and expected in last, last
