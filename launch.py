r"""Runs an experiment from a config file.

  python launch.py --config=configs/default.py[:variant=NAME] \
      [--config.key=value ...] [--workdir=DIR] [--verbosity=0]

With no flags it runs configs/default.py into a new directory under runs/. A
workdir holding a checkpoint is resumed; one that another run holds is
refused. On several hosts, start one process per host with the same flags
plus `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, or
none of them under SLURM (or another cluster `jax.distributed.initialize()`
detects). Anything that stops a run ends the process with one
`launch.py: error: ...` line and a non-zero exit status.
"""

import importlib.util
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (default: a new one under runs/).")
_FRESH = flags.DEFINE_bool(
    "fresh", False, "Start the workdir afresh: an earlier run's results and "
    "checkpoints are moved aside to <workdir>/previous-N/ first.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0, for multi-host runs.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes of a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0 to num_processes - 1.")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_init_timeout", 120, "Seconds a multi-host run waits for all "
    "its processes to join before it stops, naming the missing one.",
    lower_bound=1)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "distributed_heartbeat_timeout", 60, "Seconds without a heartbeat after "
    "which a process of a multi-host run is taken for dead; the launcher "
    "stops the others, naming it, after half of this.", lower_bound=2)


def main(argv):
  from stalepipe.train import launcher  # pylint: disable=g-import-not-at-top
  launcher.main(_CONFIG.value, sys.argv, _WORKDIR.value, launcher.Distributed(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
      _INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value), _FRESH.value)


if __name__ == "__main__":
  # By path: the package would import JAX before the devices are set up.
  _spec = importlib.util.spec_from_file_location("prelude", os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "stalepipe/train/prelude.py"))
  prelude = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(prelude)
  prelude.before_jax(sys.argv)
  _CONFIG = prelude.define_config(sys.argv, lambda: config_flags.DEFINE_config_file(
      "config", prelude.DEFAULT_CONFIG, "Experiment config file.",
      lock_config=True))
  app.run(main, flags_parser=prelude.parse_flags)
