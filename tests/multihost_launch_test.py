"""Two launcher processes on 127.0.0.1 end where one process does.

Each process has 4 emulated CPU devices and talks over gloo; together they
form the same ('data', 'stage') = (2, 4) mesh as one process with 8 devices.
Each loads only its data replica's shard, checkpoints collectively, and
the final parameters must equal the single-process run's bit for bit, also
when the two-process run stops half way and resumes from its checkpoint.
"""

import json
import os
import re
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import launching

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = ["--config=configs/pipedream.py", "--config.num_steps=24",
         "--config.model_kwargs.hidden=16", "--config.eval_every=0",
         "--config.plots=False", "--config.checkpoint_every=12",
         "--config.log_every=12"]


_free_port = launching.free_port


def _env(devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return env


def _params(workdir) -> dict[str, np.ndarray]:
  with np.load(os.path.join(workdir, "params.npz")) as f:
    return dict(f)


def _two_processes(workdir, *flags):
  port = _free_port()
  procs = [_process(workdir, port, i, *flags) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_two_processes_match_one_also_across_a_resume(tmp_path):
  single, multi = tmp_path / "single", tmp_path / "multi"
  one = subprocess.run([sys.executable, "launch.py", *FLAGS,
                        f"--workdir={single}"], cwd=ROOT, env=_env(8),
                       capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  _two_processes(multi, "--config.num_steps=12")  # stops half way ...
  _two_processes(multi)  # ... and resumes from its checkpoint to 24
  assert "num_processes" in (multi / "summary.json").read_text()
  assert '"resumed_from_step": 12' in (multi / "summary.json").read_text()
  want, got = _params(single), _params(multi)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # The final evaluation through the mesh, each process passing its slice,
  # on the drained weights.
  one, two = (json.loads((w / "summary.json").read_text())
              for w in (single, multi))
  assert two["drained_minibatches"] == one["drained_minibatches"] > 0
  assert two["test_accuracy"] == one["test_accuracy"]
  assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-6)


FSDP_ACROSS = ("--config.num_replicas=1", "--config.stage_devices=1",
               "--config.fsdp=8")  # the 4 stages on one 'stage' device,
#   sharded over all 8 devices: 4 of each process


@pytest.mark.slow
def test_an_fsdp_axis_across_two_processes_trains_what_one_does(tmp_path):
  """Each member gathers parts from the other process's devices and
  reduce-scatters into them (gloo); each process loads the one replica's
  data and places its members' columns. The reduce-scatter adds the 8
  members' gradients in another order over gloo than in one process, so
  the weights agree to float32 rounding, not bit for bit."""
  single, multi = tmp_path / "single", tmp_path / "multi"
  one = subprocess.run([sys.executable, "launch.py", *FLAGS, *FSDP_ACROSS,
                        f"--workdir={single}"], cwd=ROOT, env=_env(8),
                       capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  _two_processes(multi, *FSDP_ACROSS)
  want, got = _params(single), _params(multi)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
  one, two = (json.loads((w / "summary.json").read_text())
              for w in (single, multi))
  assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)


def test_partial_multihost_flags_are_a_one_line_error(tmp_path):
  result = subprocess.run(
      [sys.executable, "launch.py", "--num_processes=2",
       f"--workdir={tmp_path}"], cwd=ROOT, env=_env(8), capture_output=True,
      text=True, timeout=120)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error: --coordinator_address, "
                         "--num_processes and --process_id are invalid alone")


def _process(workdir, port, i, *flags):
  return launching.peer(i, port, *FLAGS, *flags, f"--workdir={workdir}")


@pytest.mark.parametrize("present", [0, 1])
def test_a_peer_that_never_starts_is_named_in_one_line(tmp_path, present):
  start = time.time()
  proc = _process(tmp_path / "w", _free_port(), present,
                  "--distributed_init_timeout=3")
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 1 and time.time() - start < 60
  assert err.strip().splitlines() == [
      f"launch.py: error: process {present} of 2: process {1 - present} did "
      "not join the coordinator at 127.0.0.1:" + err.split("127.0.0.1:")[1]
      .split()[0] + " within 3 s (--distributed_init_timeout); start every "
      "process with the same --coordinator_address and --num_processes"]
  assert not (tmp_path / "w").exists()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
    return f.read().split(")")[-1].split()[0] != "Z"


def _workers(parent: int) -> list[int]:
  """The launcher's supervised child (`stalepipe/train/supervise.py`)."""
  with open(f"/proc/{parent}/task/{parent}/children") as f:
    return [int(p) for p in f.read().split()]


def _kill_one_mid_run(tmp_path, victim: int, heartbeat_timeout: int):
  """Two processes train; once metrics appear, the launcher of `victim` is
  SIGKILLed. Returns its worker pids, and the survivor's exit code, seconds
  to end after the kill, and stderr. (A short heartbeat timeout makes the
  watch quick, and on a loaded machine may take a compiling peer for lost.)"""
  port, workdir = _free_port(), tmp_path / "w"
  procs = [_process(workdir, port, i, "--config.num_steps=400000",
                    "--config.log_every=1", "--config.checkpoint_every=0",
                    f"--distributed_heartbeat_timeout={heartbeat_timeout}")
           for i in range(2)]
  survivor, metrics = procs[1 - victim], workdir / "metrics.jsonl"
  while not (metrics.exists() and metrics.stat().st_size):
    assert survivor.poll() is None, survivor.communicate()[1][-2000:]
    time.sleep(0.1)
  workers = _workers(procs[victim].pid)
  if victim == 1:  # the run holds its workdir once, on process 0
    other = subprocess.run(
        [sys.executable, "launch.py", *FLAGS, f"--workdir={workdir}"],
        cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=300)
    holder = _workers(procs[0].pid)[0]
    assert other.stderr.strip().splitlines() == [
        f"launch.py: error: --workdir={workdir} is in use by PID {holder} on "
        f"host {socket.gethostname()}; valid: wait for that run to end, or a "
        "new --workdir"], other.stderr[-2000:]
  procs[victim].kill()
  procs[victim].communicate()
  start = time.time()
  _, err = survivor.communicate(timeout=120)
  return workers, survivor.returncode, time.time() - start, err


@pytest.mark.slow
def test_a_dead_coordinator_is_named_in_one_line(tmp_path):
  """Process 0 (JAX's coordination service) killed mid-run: process 1's
  client aborts in C++ at once; its launcher says so in one line."""
  workers, code, seconds, err = _kill_one_mid_run(
      tmp_path, victim=0, heartbeat_timeout=60)  # noticed at once, not by it
  assert code == 1 and seconds < 30, err[-3000:]
  # The service's abort, or (racing it) a collective that lost its peer.
  assert re.fullmatch(
      r"launch\.py: error: process 1 of 2(: lost the coordinator,| lost "
      r"contact with) process 0, which stopped or crashed \(see its own "
      r"output\): (UNAVAILABLE|UNKNOWN): .*", err.strip()), err[-3000:]
  # The killed launcher's worker died with it: a dead process to its peers.
  assert len(workers) == 1 and not _alive(workers[0])


@pytest.mark.slow
def test_a_peer_that_dies_is_named_in_one_line(tmp_path):
  _, code, seconds, err = _kill_one_mid_run(tmp_path, victim=1,
                                         heartbeat_timeout=20)
  # docs/running.md: the survivor stops within half the heartbeat timeout.
  assert code == 1 and seconds < 20 / 2, (seconds, err[-3000:])
  # Whichever notices first, the heartbeat watch or the failed collective,
  # the last line names the missing process.
  last = err.strip().splitlines()[-1]
  assert re.fullmatch(
      r"launch\.py: error: process 0 of 2(: process 1 stopped \(no sign of it "
      r"for [\d.]+ s; see its own output\); stopping| lost contact with "
      r"process 1, which stopped or crashed \(see its own output\): .*)",
      last), err[-3000:]
  assert "Traceback" not in err and "Check failure" not in err
  assert len(err.strip().splitlines()) <= 12  # its progress lines and this
