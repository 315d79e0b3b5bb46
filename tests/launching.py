"""What the tests that start processes share: `launch.py` runs and free
ports."""

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launch(*args, workdir=None, env=None, wait=True, cwd=ROOT, timeout=300,
           **kwargs):
  """Runs `launch.py --workdir=W *args` (no `--workdir` where `workdir` is
  None) with the launcher's own device set-up (`XLA_FLAGS` cleared, `env`
  added): its `CompletedProcess`, or with `wait=False` its `Popen`."""
  env = dict(os.environ, **(env or {}))
  env.pop("XLA_FLAGS", None)  # the launcher sets up its own devices
  cmd = [sys.executable, str(ROOT / "launch.py"),
         *([f"--workdir={workdir}"] if workdir is not None else []), *args]
  if not wait:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)
  return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout, **kwargs)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def peer(i: int, port: int, *args, devices: int = 4, env=None
         ) -> subprocess.Popen:
  """Process `i` of a two-process `launch.py *args` on 127.0.0.1:`port`,
  `devices` emulated CPU devices each (`env` added)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             **(env or {}))
  return subprocess.Popen(
      [sys.executable, "launch.py", *args,
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
