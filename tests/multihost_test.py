"""Two processes on 127.0.0.1 (gloo) give the parameters of one process."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests import launching

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


_free_port = launching.free_port


def _run(num_processes, out, *args):
  port = str(_free_port())
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), port, str(num_processes), str(i), str(out),
       *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(num_processes)]
  for p in procs:
    output, _ = p.communicate(timeout=240)
    assert p.returncode == 0, output[-3000:]
  return np.load(out)


_SPECS = [
    {"schedule": "pipedream", "schedule_kwargs": {}, "sync": "bsp",
     "sync_kwargs": {}},
    {"schedule": "hetpipe", "schedule_kwargs": {"concurrent_minibatches": 2},
     "sync": "wsp", "sync_kwargs": {"clock_distance": 1,
                                    "concurrent_minibatches": 2}},
    {"schedule": "1f1b", "schedule_kwargs": {}, "sync": "sdpipe",
     "sync_kwargs": {"history": 2, "window": 0.1, "ready_times": [
         [[0.0, 0.01, 0.5, 0.52], [0.0, 0.3, 0.31, 0.9]]] * 8}},
]


# Two processes each (about 14 s a spec): with the slow tests, to keep the
# quick suite under 5 minutes on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("spec", _SPECS, ids=lambda s: s["sync"])
def test_two_processes_match_one(tmp_path, spec):
  args = (json.dumps(spec),)
  one = _run(1, tmp_path / "one.npz", *args)
  two = _run(2, tmp_path / "two.npz", *args)
  assert set(one.files) == set(two.files)
  for name in one.files:
    np.testing.assert_allclose(two[name], one[name], rtol=1e-6, atol=1e-7)
