"""The launcher end to end, and its one-line errors on bad input."""

import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from stalepipe.pipeline import stage as stage_lib
from tests import launching

ROOT = pathlib.Path(__file__).resolve().parents[1]


_launch = launching.launch


def _one_error_line(result) -> str:
  """The launcher's only stderr line, after checking it is one."""
  assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith("launch.py: error: "), lines[0]
  return lines[0]


def test_default_launch_trains_to_90_percent(tmp_path):
  result = _launch(workdir=tmp_path, )
  assert result.returncode == 0, result.stderr[-2000:]
  # The console: where the config is, progress lines (no carriage returns
  # in a pipe), the evaluations and the summary; no library logs.
  assert "\r" not in result.stderr
  lines = (result.stdout + result.stderr).strip().splitlines()
  assert len(lines) <= 17, lines
  assert lines[0].startswith("config configs/default.py (resolved: ")
  progress = [l for l in lines if " steps/s  ETA " in l]
  assert 9 <= len(progress) <= 11 and progress[-1].startswith("step 800/800")
  evals = [l for l in lines if "test accuracy" in l and l.startswith("step")]
  assert len(evals) == 4, lines
  assert not [l for l in lines if re.match(r"[IWEF]\d{4} ", l)], lines
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["test_accuracy"] >= 0.9
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(line)["step"] for line in lines]
  # Every name the trainer records is reserved: no metric can overwrite it.
  names = {k for line in lines for k in json.loads(line)}
  assert names <= set(stage_lib.RESERVED), names
  assert steps == sorted(steps) and steps[-1] == summary["steps"]
  assert json.loads((tmp_path / "config.json").read_text())["schedule"] == "gpipe"
  assert "test accuracy" in result.stdout
  assert summary["seconds"] < 60
  for name in ("loss.png", "schedule.png", "params.npz"):
    assert (tmp_path / name).stat().st_size > 0, name
  assert any("tfevents" in p.name for p in (tmp_path / "tb").iterdir())
  assert str(summary["steps"]) in os.listdir(tmp_path / "checkpoints")


@pytest.mark.parametrize("args,expected", [
    (["--config.no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--config.num_replicas=4"], "4 x 4 = 16 devices does not fit the 8"),
    (["--config.num_stages=6", "--config.num_replicas=1"],
     "num_stages=6 does not fit a model of 4 blocks; valid: 1 to 4"),
    (["--config.minibatches_per_window=3"],
     "num_steps=4 is invalid; valid: a positive multiple of "
     "minibatches_per_window=3"),
])
def test_bad_input_exits_with_one_line(tmp_path, args, expected):
  result = _launch(*args, "--config.num_steps=4", workdir=tmp_path / "w")
  assert expected in _one_error_line(result)
  assert not (tmp_path / "w").exists()


def _config_file(tmp_path, text):
  path = tmp_path / "my_config.py"
  path.write_text(text)
  return f"--config={path}"


# Refused before JAX is even imported: fast.
@pytest.mark.parametrize("make_args,expected", [
    (lambda p: ["--config=configs/no_such.py"],
     "--config=configs/no_such.py is invalid: no such file; valid: a config "
     "file"),
    (lambda p: [_config_file(p, "def get_config(arg=None):\n  1 / 0\n")],
     "my_config.py failed: ZeroDivisionError: division by zero"),
    (lambda p: [_config_file(p, "def get_config(arg=None)\n  pass\n")],
     "my_config.py has a syntax error at line 1: expected ':'"),
    (lambda p: [_config_file(p, "X = 1\n")],
     "it defines no get_config(arg)"),
    (lambda p: ["--config=configs/default.py:variant=no_such"],
     "default.py:variant=no_such failed: ValueError: variant 'no_such' is "
     "invalid; valid: mlp_digits, "),
    (lambda p: ["--config=configs/default.py:nope=1"],
     "config argument 'nope' is invalid; valid: variant"),
    (lambda p: ["--config.num_stages=abc"],
     "num_stages='abc' is invalid; valid: an integer"),
    (lambda p: ["--config.plots=maybe"],
     "plots='maybe' is invalid; valid: True or False"),
    (lambda p: ["--config.model_kwargs.hidden.x=1"],
     "unknown config key 'model_kwargs.hidden.x': int has no field 'x'"),
])
def test_bad_config_file_or_override_is_one_line(tmp_path, make_args,
                                                 expected):
  result = _launch(*make_args(tmp_path), workdir=tmp_path / "w")
  assert expected in _one_error_line(result)
  assert not (tmp_path / "w").exists() and not result.stdout


@pytest.fixture
def scratch():
  """A directory the (unprivileged) launcher may write, outside pytest's
  root-only tmp."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="stalepipe-launch-"))
  if os.getuid() == 0:
    os.chown(path, 65534, 65534)
  yield path
  for p in path.rglob("*"):
    if p.is_dir():
      p.chmod(0o755)
  shutil.rmtree(path)


def _launch_unprivileged(*args, workdir, home):
  """Starts the launcher as nobody when root, who ignores file modes."""
  env = dict(os.environ, HOME=str(home))
  env.pop("XLA_FLAGS", None)
  prefix = []
  if os.getuid() == 0:
    if not shutil.which("setpriv"):
      pytest.skip("root without setpriv: file modes cannot be tested")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
  return subprocess.Popen(
      [*prefix, sys.executable, "launch.py", f"--workdir={workdir}", *args],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def test_workdir_that_is_a_file_or_read_only_is_refused(tmp_path, scratch):
  regular = tmp_path / "a_file"
  regular.write_text("keep me")
  result = _launch(workdir=regular)
  assert (f"--workdir={regular} is invalid: it is a file; valid: a "
          "directory" in _one_error_line(result))
  assert regular.read_text() == "keep me"
  locked = scratch / "locked"
  locked.mkdir()
  if os.getuid() == 0:
    os.chown(locked, 65534, 65534)
  locked.chmod(0o555)
  proc = _launch_unprivileged(workdir=locked / "run", home=scratch)
  out, err = proc.communicate(timeout=300)
  result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
  assert (f"--workdir={locked / 'run'} is invalid: {locked} is not writable"
          in _one_error_line(result))
  assert not os.listdir(locked)


@pytest.mark.slow
def test_checkpoints_becoming_unwritable_ends_the_run_in_one_line(scratch):
  workdir = scratch / "run"
  proc = _launch_unprivileged(
      "--config.num_steps=40000", "--config.checkpoint_every=8",
      "--config.log_every=4", "--config.eval_every=0", workdir=workdir,
      home=scratch)
  metrics = workdir / "metrics.jsonl"
  while not (metrics.exists() and metrics.stat().st_size):
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(0.05)
  (workdir / "checkpoints").chmod(0o555)
  out, err = proc.communicate(timeout=120)  # it used to hang here
  result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
  line = _one_error_line(result)
  assert f"saving checkpoints in {workdir}/checkpoints failed" in line
  assert "Permission denied" in line


@pytest.mark.slow
def test_disk_full_while_saving_is_one_line_and_the_rerun_resumes(tmp_path):
  def small_files():  # every file past 200 kB fails, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
  result = _launch("--config.num_steps=800", "--config.checkpoint_every=8",
                   "--config.eval_every=0", "--config.model_kwargs.hidden=64",
                   "--config.plots=False", workdir=tmp_path / "big",
                   preexec_fn=small_files)
  line = _one_error_line(result)
  assert "saving checkpoints in" in line and "File too large" in line, line
  steps = [p.name for p in (tmp_path / "big" / "checkpoints").iterdir()
           if p.name.isdigit()]
  # Without a checkpoint to resume, the first run's records are kept aside.
  rerun = _launch("--config.num_steps=800", "--config.checkpoint_every=8",
                  "--config.eval_every=0", "--config.model_kwargs.hidden=64",
                  "--config.plots=False", *([] if steps else ["--fresh"]),
                  workdir=tmp_path / "big")
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  summary = json.loads((tmp_path / "big" / "summary.json").read_text())
  assert summary["resumed_from_step"] == (
      max(map(int, steps)) if steps else None)


# Each the launcher's full start (JAX imported, the config checked): slow.
ISSUE_CASES = [
    (["--config.num_stages=0"], "num_stages=0 is invalid; valid: an "
     "integer >= 1"),
    (["--config.num_stages=-1"], "num_stages=-1 is invalid"),
    (["--config.num_replicas=0"], "num_replicas=0 is invalid"),
    (["--config.num_replicas=-1"], "num_replicas=-1 is invalid"),
    (["--config.microbatch_size=0"], "microbatch_size=0 is invalid"),
    (["--config.microbatch_size=-3"], "microbatch_size=-3 is invalid"),
    (["--config.log_every=0"], "log_every=0 is invalid"),
    (["--config.model_kwargs.hidden=0"], "model_kwargs.hidden=0 is invalid"),
    (["--config.model_kwargs.hidden=-8"], "model_kwargs.hidden=-8 is invalid"),
    (["--config.optimizer=softmax_cross_entropy"],
     "optimizer='softmax_cross_entropy' is invalid; valid: an optax "
     "optimizer"),
    (["--config.sync=wsp"], "sync_kwargs.clock_distance is missing"),
    (["--config=configs/sapipe.py", "--config.transforms=(('delay_compensation'"
      ", {'lam': 0.2, 'lamda': 1}),)"],
     "delay_compensation.lamda=1 is invalid: transform 'delay_compensation' "
     "takes no 'lamda'; valid keys: lam, form, delay, adaptive, eps, decay"),
    (["--config=configs/default.py:variant=vgg_cifar10"],
     "dataset_kwargs.data_dir='~/data/cifar-10-batches-py' is invalid"),
    (["--config.optimizer_kwargs.learning_rate=-1"],
     "optimizer_kwargs.learning_rate=-1.0 is invalid; valid: a number > 0"),
    (["--config=configs/sapipe.py", "--config.transforms=(('delay_compensation'"
      ", {'lam': -1.0}),)"], "delay_compensation.lam=-1.0 is invalid"),
    (["--config.eval_every=-1"], "eval_every=-1 is invalid"),
    (["--config.checkpoint_every=-1"], "checkpoint_every=-1 is invalid"),
    (["--config.seed=-1"], "seed=-1 is invalid; valid: an integer in [0, 2**32)"),
    (["--config.minibatches_per_window=0"],
     "minibatches_per_window=0 is invalid"),
    (["--config.schedule_kwargs.foo=1"],
     "--config.schedule_kwargs.foo is invalid: schedule 'gpipe' takes no "
     "'foo'; valid keys: none"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,expected", ISSUE_CASES,
                         ids=[" ".join(a) for a, _ in ISSUE_CASES])
def test_issue_bad_values_are_one_line_and_touch_nothing(tmp_path, args,
                                                         expected):
  result = _launch(*args, workdir=tmp_path / "w")
  assert expected in _one_error_line(result)
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_nan_loss_exits_with_one_line_naming_the_step(tmp_path):
  result = _launch("--config.optimizer=sgd",
                   "--config.optimizer_kwargs.learning_rate=3",
                   "--config.num_steps=400", "--config.checkpoint_every=4",
                   "--config.log_every=400", workdir=tmp_path)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error: loss is ") and " at step " in last
  assert "last good checkpoint: " in last, last


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_the_rerun_resumes(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  args = [sys.executable, "launch.py", f"--workdir={tmp_path}",
          "--config.num_steps=800", "--config.log_every=4",
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


@pytest.mark.slow
def test_one_layer_per_stage_transformer_on_stdlib_runs_two_steps(tmp_path):
  result = _launch(
      "--config=configs/default.py:variant=transformer_stdlib",
      f"--config.dataset_kwargs.cache_dir={tmp_path / 'cache'}",
      "--config.num_steps=2", "--config.minibatches_per_window=1",
      "--config.plots=False", workdir=tmp_path / "w")
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads((tmp_path / "w" / "summary.json").read_text())
  assert summary["steps"] == 2 and summary["test_loss"] < np.log(256)
  config = json.loads((tmp_path / "w" / "config.json").read_text())
  assert config["model_kwargs"]["num_layers"] == config["num_stages"]
  with np.load(tmp_path / "w" / "params.npz") as params:
    assert {params[k].dtype for k in params.files} == {np.dtype("float32")}
  (cache,) = (tmp_path / "cache").iterdir()
  assert cache.name.startswith("stdlib-py")
