"""Faults: nothing lost, nothing hangs, every stop and bad input in one line.

Each test sets up the fault as a user or a cluster would meet it and checks
what the run does against what must hold: a run's results are never
overwritten, every file is whole after a kill, a multi-host run refuses
processes with different configs, disk use stays bounded, every part of a
checkpoint is verified, and a stop or bad input is one line.
"""

import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time

import pytest

from tests import launching

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stalepipe.pipeline import executor  # pylint: disable=g-import-not-at-top
from stalepipe.train import build  # pylint: disable=g-import-not-at-top
from stalepipe.train import launcher  # pylint: disable=g-import-not-at-top
from stalepipe.train import loop  # pylint: disable=g-import-not-at-top
from stalepipe.train import metrics  # pylint: disable=g-import-not-at-top
from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
from tests import run_path_test  # pylint: disable=g-import-not-at-top

tiny = run_path_test.tiny


def _bytes(path: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(path)): p.read_bytes()
          for p in sorted(path.rglob("*")) if p.is_file()}


def _flip(step_dir: pathlib.Path) -> None:
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  victim = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  for i in range(len(data) // 2, len(data) // 2 + 8):
    data[i] ^= 0xFF
  victim.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_run_whose_checkpoints_failed_is_not_overwritten_by_a_rerun(
    tmp_path):
  config = tiny(num_steps=8, checkpoint_every=4)
  trainer.train_and_evaluate(config, str(tmp_path))
  for step in (4, 8):
    _flip(tmp_path / "checkpoints" / str(step))
  config.num_steps = 12  # continue it
  with pytest.raises(ValueError, match="no checkpoint in .* verifies"):
    trainer.train_and_evaluate(config, str(tmp_path))
  kept = {k: v for k, v in _bytes(tmp_path).items()
          if k in ("metrics.jsonl", "summary.json", "params.npz")}
  # The same command again: refused, the results untouched.
  with pytest.raises(ValueError, match=r"holds a run's results \(metrics.jsonl"
                     r", summary.json, params.npz\) but no checkpoint to "
                     "resume; valid: a new --workdir, or --fresh"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert {k: _bytes(tmp_path)[k] for k in kept} == kept


@pytest.mark.slow
def test_results_without_checkpoints_are_kept_and_fresh_moves_them_aside(
    tmp_path):
  config = tiny(num_steps=8)
  trainer.train_and_evaluate(config, str(tmp_path))
  for p in (tmp_path / "checkpoints").iterdir():
    if p.is_dir():
      for q in sorted(p.rglob("*"), reverse=True):
        q.unlink() if q.is_file() else q.rmdir()
      p.rmdir()
  # A hook's own records (StageNorms' stage_norms.jsonl) belong to the run.
  (tmp_path / "stage_norms.jsonl").write_text('{"step": 8}\n')
  before = _bytes(tmp_path)
  with pytest.raises(ValueError, match="holds a run's results"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert _bytes(tmp_path) == before
  summary = trainer.train(build.parts(config), str(tmp_path), fresh=True)
  assert summary["steps"] == 8 and summary["resumed_from_step"] is None
  aside = tmp_path / "previous-1"
  for name in ("metrics.jsonl", "summary.json", "params.npz",
               "stage_norms.jsonl"):
    assert (aside / name).read_bytes() == before[name], name
  assert not (tmp_path / "stage_norms.jsonl").exists()
  # A second fresh start keeps the first one's files where they are.
  trainer.train(build.parts(config), str(tmp_path), fresh=True)
  assert (tmp_path / "previous-2" / "summary.json").exists()
  assert (aside / "stage_norms.jsonl").read_bytes() == before[
      "stage_norms.jsonl"]


def test_resumed_metrics_are_whole_on_disk_before_the_first_new_record(
    tmp_path):
  """A kill between the reopen and the first new record loses nothing."""
  records = [{"step": s, "loss": 1.0 / s} for s in range(1, 11)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  writer = metrics.Writer(str(tmp_path), True, resume_step=6)
  kept = [json.loads(line) for line in path.read_text().splitlines()]
  assert kept == records[:6]  # on disk now, not in a buffer
  writer.write(7, {"loss": 0.5})
  assert json.loads(path.read_text().splitlines()[-1]) == {"step": 7,
                                                           "loss": 0.5}
  writer.close()


def test_retired_checkpoints_do_not_pile_up_during_a_run(tmp_path):
  """At most keep_checkpoints steps plus one are on disk at any time."""
  seen = []

  class CountSteps:
    every = 2

    def __call__(self, run):
      checkpoints = tmp_path / "checkpoints"
      deleted = checkpoints / "deleted"
      steps = [p for p in checkpoints.iterdir() if p.name[0].isdigit()]
      seen.append(len(steps) + (len(list(deleted.iterdir()))
                                if deleted.exists() else 0))

  trainer.train_and_evaluate(tiny(num_steps=24, checkpoint_every=2,
                                  keep_checkpoints=2), str(tmp_path),
                             hooks=[CountSteps()])
  assert max(seen) <= 3, seen  # 2 kept + 1 being written


@pytest.mark.slow
def test_an_edited_position_record_is_not_trusted(tmp_path):
  config = tiny(num_steps=8, checkpoint_every=4)
  trainer.train_and_evaluate(config, str(tmp_path))
  metadata = tmp_path / "checkpoints" / "8" / "position" / "metadata"
  record = json.loads(metadata.read_text())
  record["step"] = 2
  metadata.write_text(json.dumps(record))
  (tmp_path / "summary.json").unlink()
  summary = trainer.train_and_evaluate(tiny(num_steps=12, checkpoint_every=4),
                                       str(tmp_path))
  assert summary["resumed_from_step"] == 4
  assert "position record checksum mismatch" in summary[
      "skipped_checkpoints"][0]


def test_a_window_far_too_large_is_refused_before_the_pipeline_is_built(
    monkeypatch):
  def never(*args, **kwargs):
    raise AssertionError("the pipeline was built")

  monkeypatch.setattr(executor, "Pipeline", never)
  for overrides in ({"num_microbatches": 1000},
                    {"minibatches_per_window": 1_000_000,
                     "num_steps": 1_000_000}):
    with pytest.raises(ValueError, match="examples per window, but a data "
                       "replica's shard has"):
      build.parts(tiny(**overrides))


_launch = launching.launch


def _one_line(result) -> str:
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith("launch.py: error: "), lines[0]
  return lines[0][len("launch.py: error: "):]


def _config_file(tmp_path, text):
  path = tmp_path / "cfg.py"
  path.write_text(text)
  return f"--config={path}"


BAD_INPUT = [
    (lambda p: ["--config.seed=99999999999999999999"],
     "seed=99999999999999999999 is invalid; valid: an integer that fits 64 "
     "bits"),
    (lambda p: ["--config.seed=4294967296"],
     "seed=4294967296 is invalid; valid: an integer in [0, 2**32)"),
    (lambda p: [_config_file(p, "def get_config(arg=None):\n  return None\n")],
     "get_config returned NoneType; valid: a ConfigDict"),
    (lambda p: [_config_file(p, "def get_config(arg=None):\n"
                                "  return {'seed': 0}\n")],
     "get_config returned dict; valid: a ConfigDict "
     "(ml_collections.ConfigDict(d) wraps a dict)"),
    (lambda p: [_config_file(p, "import sys\ndef get_config(arg=None):\n"
                                "  sys.exit(3)\n")],
     "called sys.exit(3); valid: a get_config that returns a ConfigDict"),
    (lambda p: ["--config.num_steps=8", "--config=configs/1f1b.py"],
     "Found --config.num_steps=8 in argv before a value for --config was "
     "specified; valid: --config=FILE first"),
    (lambda p: ["--foo=1"], "Unknown command line flag 'foo'"),
    (lambda p: ["--verbosity=abc"], "--verbosity=abc is invalid: "),
    (lambda p: ["stray"], "unexpected argument 'stray'; valid: flags only"),
]


@pytest.mark.parametrize("make_args,expected", BAD_INPUT,
                         ids=[e[:30] for _, e in BAD_INPUT])
def test_bad_input_is_one_line(tmp_path, make_args, expected):
  result = _launch(*make_args(tmp_path), workdir=tmp_path / "w")
  assert expected in _one_line(result)
  assert not (tmp_path / "w").exists() and not result.stdout


def test_an_empty_workdir_flag_is_refused(tmp_path):
  result = _launch("--workdir=", workdir=None, cwd=tmp_path)
  assert _one_line(result).startswith("--workdir= is invalid: empty")


@pytest.mark.slow
@pytest.mark.parametrize("args,env,expected", [
    ([], {"JAX_PLATFORMS": "tpu"}, "JAX_PLATFORMS='tpu' is invalid here: "),
    (["--coordinator_address=not_a_host", "--num_processes=2",
      "--process_id=0"], {}, "--coordinator_address=not_a_host is invalid; "
     "valid: HOST:PORT with a port in 1..65535"),
    (["--coordinator_address=127.0.0.1:99999", "--num_processes=2",
      "--process_id=0"], {}, "--coordinator_address=127.0.0.1:99999 is "
     "invalid; valid: HOST:PORT"),
])
def test_platform_and_coordinator_are_checked_in_one_line(tmp_path, args,
                                                          env, expected):
  result = _launch(*args, workdir=tmp_path / "w", env=env)
  if "--num_processes=2" in args:  # the supervising parent says it too
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and expected in last, result.stderr[-2000:]
  else:
    assert expected in _one_line(result)


def _start(*args, workdir):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(
      [sys.executable, "launch.py", f"--workdir={workdir}", *args], cwd=ROOT,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _status_field(pid: int, name: str) -> str:
  """A field of /proc/PID/status ("0" once the process is gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith(name + ":"):
          return line.split()[1]
  except FileNotFoundError:
    pass
  return "0"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_before_training_is_one_line(tmp_path, signum):
  proc = _start(workdir=tmp_path)
  # Once the launcher catches SIGHUP (bit 0 of the caught-signal mask; it sets
  # its three handlers together), not before: a signal while Python imports
  # absl, in the first tenths of a second, is a traceback (docs/running.md).
  while not int(_status_field(proc.pid, "SigCgt"), 16) & 1:
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(0.01)
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=120)
  lines = err.strip().splitlines()
  assert proc.returncode == 1 and len(lines) == 1, err[-3000:]
  assert lines[0] == (f"launch.py: error: stopped by {signum.name} before "
                      "training started; nothing was saved")


@pytest.mark.slow
def test_sighup_during_training_checkpoints_and_stops(tmp_path):
  proc = _start("--config.num_steps=40000", "--config.log_every=4",
                "--config.eval_every=0", workdir=tmp_path)
  metrics_file = tmp_path / "metrics.jsonl"
  while not (metrics_file.exists() and metrics_file.stat().st_size):
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGHUP)
  _, err = proc.communicate(timeout=120)
  last = err.strip().splitlines()[-1]
  assert last.startswith("launch.py: stopped by SIGHUP at step "), last


@pytest.mark.slow
def test_a_metrics_write_that_fails_ends_in_one_line(tmp_path):
  """A full disk under metrics.jsonl and TensorBoard: one line, no hang."""
  def small_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))
  result = _launch("--config.num_steps=400000", "--config.log_every=4",
                   "--config.eval_every=0", "--config.checkpoint_every=0",
                   "--config.plots=False", workdir=tmp_path,
                   preexec_fn=small_files)
  line = _one_line(result)
  assert line.startswith("writing ") and "File too large" in line, line


_free_port = launching.free_port


@pytest.mark.slow
def test_processes_with_different_configs_each_refuse_in_one_line(tmp_path):
  port = _free_port()
  procs = [launching.peer(i, port, "--config=configs/pipedream.py", *extra,
                          f"--workdir={tmp_path}")
           for i, extra in enumerate(([], ["--config.num_steps=200"]))]
  for i, proc in enumerate(procs):
    _, err = proc.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    mine, theirs = (800, 200) if i == 0 else (200, 800)
    assert proc.returncode == 1 and last == (
        f"launch.py: error: process {i} of 2 runs another config than "
        f"process {1 - i}: num_steps={mine} (process {1 - i}: {theirs}); "
        "valid: the same --config and --config.* flags on every process"), (
            err[-3000:])
  assert not (tmp_path / "metrics.jsonl").exists()


# Imported by process 1 only (PYTHONPATH): `build.parts` sleeps first, so
# process 0 reaches its line well before.
_HOLD_BUILD = """
import importlib.abc, importlib.machinery, sys, time
class _Hold(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != "stalepipe.train.build":
      return None
    sys.meta_path.remove(self)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    run = spec.loader.exec_module
    def exec_module(module):
      run(module)
      parts = module.parts
      module.parts = lambda config: (time.sleep(5), parts(config))[1]
    spec.loader.exec_module = exec_module
    return spec
sys.meta_path.insert(0, _Hold())
"""


@pytest.mark.slow
def test_a_config_no_process_can_build_is_refused_by_each_in_one_line(
    tmp_path):
  """Every process says why, also one that gets there 5 s after process 0
  (which hosts the coordinator and leaves last); none says it lost it."""
  (tmp_path / "hold").mkdir()
  (tmp_path / "hold" / "sitecustomize.py").write_text(_HOLD_BUILD)
  port = _free_port()
  procs = [launching.peer(i, port, "--config=configs/pipedream.py",
                          "--config.num_replicas=1",
                          f"--workdir={tmp_path / 'w'}", env=env)
           for i, env in enumerate(({}, {"PYTHONPATH": str(tmp_path / "hold")}))]
  for proc in procs:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err.strip().splitlines()[-1] == (
        "launch.py: error: mesh num_replicas x stage devices = 4 devices "
        "leaves some of the 2 processes without a device; valid: exactly 8 "
        "(all devices of all processes)"), err[-3000:]
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


class _SigtermAt:
  """A user hook that sends this process SIGTERM at step `step` (after the
  trainer's own hooks of that window ran, so the next window's run it)."""

  def __init__(self, step):
    self.every, self.step = 2, step

  def __call__(self, run):
    if run.step == self.step:
      os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow  # trains two to four tiny runs
def test_a_preemption_in_a_checkpoint_window_is_a_preemption(tmp_path):
  """The checkpoint hook and the preemption hook save the same step: one
  save, and the run ends preempted (not failed); the rerun finishes it."""
  config = tiny(num_steps=8, checkpoint_every=2)
  first = trainer.train_and_evaluate(config, str(tmp_path), [_SigtermAt(2)])
  assert first["preempted"] == "SIGTERM" and first["steps"] == 4
  assert (tmp_path / "checkpoints" / "4").is_dir()
  second = trainer.train_and_evaluate(config, str(tmp_path))
  assert second["resumed_from_step"] == 4 and second["steps"] == 8


def test_a_finished_run_rerun_with_another_config_is_refused(tmp_path):
  config = tiny(num_steps=4)
  trainer.train_and_evaluate(config, str(tmp_path))
  kept = _bytes(tmp_path)
  assert trainer.train_and_evaluate(config, str(tmp_path))[
      "already_finished"]
  config.optimizer_kwargs.learning_rate = 0.5
  config.seed = 3
  with pytest.raises(ValueError, match=(
      r"^the finished run in .* was trained with another config \(fields "
      r"optimizer_kwargs, seed differ\); valid: the config it was run with, "
      r"--fresh, or a new --workdir$")):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert _bytes(tmp_path) == kept


class _StopAt:
  """The documented early stop: a hook that raises `loop.Stop`."""

  def __init__(self, step):
    self.every, self.step = 2, step

  def __call__(self, run):
    if run.step >= self.step:
      raise loop.Stop("target loss reached")


@pytest.mark.slow  # trains two to four tiny runs
def test_an_early_stop_is_a_successful_end_and_its_rerun_has_nothing_to_do(
    tmp_path, capsys):
  config = tiny(num_steps=8, eval_every=4)
  summary = trainer.train_and_evaluate(config, str(tmp_path), [_StopAt(4)])
  assert summary["stopped_early"] == "target loss reached"
  assert summary["steps"] == 4 and "preempted" not in summary
  assert (tmp_path / "params.npz").exists()
  written = json.loads((tmp_path / "summary.json").read_text())
  assert written["steps"] == 4 and written["test_loss"] == summary["test_loss"]
  # The final evaluation is of the drained weights, recorded last at step 4.
  evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").open())
           if "test_loss" in r]
  assert evals[-1] == {"step": 4, "test_loss": summary["test_loss"],
                       "test_accuracy": summary["test_accuracy"]}
  kept = _bytes(tmp_path)
  again = trainer.train_and_evaluate(config, str(tmp_path), [_StopAt(4)])
  assert again["already_finished"] and _bytes(tmp_path) == kept
  launcher._report(again, str(tmp_path))
  assert "stopped early: target loss reached" in capsys.readouterr().out


@pytest.mark.slow  # trains two to four tiny runs
def test_a_hooks_figures_survive_a_preemption_and_a_rerun(tmp_path):
  """LearnsItsData's first and last losses are the whole run's after a
  SIGTERM and resume, and after a rerun that has nothing left to train."""
  hook = (("experiments.hooks:LearnsItsData", {"first": 2, "last": 2}),)
  config = tiny(num_steps=8, checkpoint_every=2, hooks=hook)
  trainer.train_and_evaluate(config, str(tmp_path / "straight"))
  want = json.loads((tmp_path / "straight" / "figures.json").read_text())
  stopped = tmp_path / "stopped"
  first = trainer.train_and_evaluate(config, str(stopped), [_SigtermAt(2)])
  assert first["preempted"] == "SIGTERM"
  trainer.train_and_evaluate(config, str(stopped))
  assert json.loads((stopped / "figures.json").read_text()) == want
  # A rerun after the end (the summary lost, say) writes the same figures.
  (stopped / "summary.json").unlink()
  trainer.train_and_evaluate(config, str(stopped))
  assert json.loads((stopped / "figures.json").read_text()) == want


@pytest.mark.slow  # trains two to four tiny runs
def test_a_nan_at_the_first_step_leaves_a_workdir_the_next_run_starts_in(
    tmp_path, capfd):
  """The run stops in one line (no tensorboardX warning before it); the
  next run moves its records aside by itself and trains."""
  config = tiny(num_steps=4, optimizer="sgd")
  config.optimizer_kwargs.learning_rate = 1e30
  with pytest.raises(ValueError, match="loss is nan at step 2"):
    trainer.train_and_evaluate(config, str(tmp_path))
  assert "NaN or Inf" not in "".join(capfd.readouterr())
  failed = (tmp_path / "metrics.jsonl").read_bytes()
  assert b"NaN" not in failed
  config.optimizer_kwargs.learning_rate = 0.01
  assert trainer.train_and_evaluate(config, str(tmp_path))["steps"] == 4
  assert (tmp_path / "previous-1" / "metrics.jsonl").read_bytes() == failed
