"""The peer watch of a multi-host run ends with it, not with an abort.

A daemon thread that is inside the runtime client's C++ when the interpreter
finalizes is ended by `pthread_exit`, and its unwinding aborts the process
("FATAL: exception not rethrown") after a run that finished: the slow CI
run of issue 13's last stop lost a two-process launch that way. Two
processes here watch each other with no pause between beats (so that the
thread is almost always inside the client) and then exit normally; each
must end with code 0 and say nothing on stderr.
"""

import pathlib
import subprocess
import sys

import pytest

from tests import launching

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = """
import sys, time, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]))
from stalepipe.train import peers
lost = []
peers.watch(60, lost.append, interval=0.0)
time.sleep(1.0)
peers.done()
assert not lost, lost
"""


_free_port = launching.free_port


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_two_watching_processes_exit_cleanly(attempt):
  del attempt  # the abort came at random; three tries, of which the old watch
  # failed at least one in each of five runs
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-c", WORKER, str(port), str(i)], cwd=ROOT,
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for i, (p, (_, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}: {err[-2000:]}"
    assert "not rethrown" not in err, f"process {i}: {err[-2000:]}"
