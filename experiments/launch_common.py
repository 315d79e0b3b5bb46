"""Running `launch.py` from an experiment: one config, one fresh workdir.

Experiments that compare methods through the launcher (the way a user runs
them) call `run` per method and seed and read the run's `summary.json`.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(config: str, overrides: dict, workdir: str) -> list[str]:
  """The launch.py command line: `--config=configs/<config>` and overrides."""
  return ([sys.executable, os.path.join(ROOT, "launch.py"),
           f"--config={os.path.join(ROOT, 'configs', config)}"]
          + [f"--config.{k}={v}" for k, v in overrides.items()]
          + [f"--workdir={workdir}"])


def run(config: str, overrides: dict, workdir: str) -> dict | None:
  """Runs launch.py (quietly) and returns its `summary.json`, or None when
  the run diverged (the launcher's NaN stop)."""
  cmd = command(config, {"eval_every": 0, "checkpoint_every": 0,
                         "plots": False, **overrides}, workdir)
  done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                        check=False)
  if done.returncode and "loss is nan" in done.stderr:
    return None
  if done.returncode:
    sys.exit(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)
