r"""Runs an experiment from a config file.

  python launch.py --config=configs/default.py[:variant=NAME] \
      [--config.key=value ...] [--workdir=DIR]

With no flags it runs configs/default.py into a new directory under runs/. A
workdir holding a checkpoint is resumed. On several hosts, start one process
per host with the same flags plus

  --coordinator_address=HOST:PORT --num_processes=N --process_id=I

or none of them under SLURM (or another cluster `jax.distributed.initialize()`
detects), which then finds them in the environment.
"""

import datetime
import importlib.util
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_DEFAULT_CONFIG = "configs/default.py"
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (default: a new one under runs/).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0, for multi-host runs.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes of a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0 to num_processes - 1.")


def _define_config_flag(argv):
  """Defines --config; an unknown override key exits with a one-line error."""
  try:
    return config_flags.DEFINE_config_file(
        "config", _DEFAULT_CONFIG, "Experiment config file.", lock_config=True)
  except (AttributeError, KeyError):
    path, arg = _DEFAULT_CONFIG, None
    for a in argv:
      if a.startswith("--config="):
        path, _, arg = a[len("--config="):].partition(":")
    spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)
    for a in argv:
      if not a.startswith("--config."):
        continue
      key, node = a[len("--config."):].partition("=")[0], config
      for part in key.split("."):
        if not hasattr(node, "keys"):
          sys.exit(f"launch.py: error: unknown config key {key!r}: "
                   f"{type(node).__name__} has no field {part!r}")
        if part not in node:
          sys.exit(f"launch.py: error: unknown config key {key!r}; valid keys "
                   f"here: {', '.join(sorted(node.keys()))}")
        node = node[part]
    raise


def _emulate_cpu_devices(count: int = 8):
  """Gives the CPU platform `count` devices unless XLA_FLAGS already does.

  Must run before JAX is imported. Accelerators, where present, are used as
  they are.
  """
  flag = f"--xla_force_host_platform_device_count={count}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _cluster_environment() -> bool:
  """Whether SLURM, Open MPI or JAX's variables describe a multi-process job."""
  sizes = (os.environ.get("SLURM_NTASKS", "1"),
           os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
  return (any(size != "1" for size in sizes)
          or "JAX_COORDINATOR_ADDRESS" in os.environ)


def _initialize_distributed():
  """Joins a multi-process run when the flags or the environment name one.

  Must run before JAX touches a device.
  """
  import jax  # pylint: disable=g-import-not-at-top
  given = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if all(v is None for v in given):
    if not _cluster_environment():
      return
  elif any(v is None for v in given):
    raise ValueError("--coordinator_address, --num_processes and "
                     "--process_id are invalid alone; valid: all three, or "
                     "none (found in a SLURM/MPI environment)")
  elif not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
    raise ValueError(f"--process_id={_PROCESS_ID.value} is invalid; valid: "
                     f"0 to {_NUM_PROCESSES.value - 1}")
  # CPU processes talk over gloo; GPUs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(*given)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = flags.FLAGS.config
  _emulate_cpu_devices()
  from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
  workdir = _WORKDIR.value or os.path.join(
      "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
  try:
    _initialize_distributed()
    print(config)
    summary = trainer.train_and_evaluate(config, workdir)
  except ValueError as e:
    sys.exit(f"launch.py: error: {e}")
  if "preempted" in summary:
    sys.exit(f"launch.py: stopped by {summary['preempted']} at step "
             f"{summary['steps']}; checkpoint {summary['checkpoint']}; run "
             "the same command again to resume")
  print(f"final loss {summary['final_loss']:.4f}  test accuracy "
        f"{summary['test_accuracy']:.2%}  "
        f"{summary['steps_per_s']:.1f} steps/s  "
        f"({summary['steps']} steps in {summary['seconds']:.1f} s)  "
        f"workdir {workdir}")


if __name__ == "__main__":
  _define_config_flag(sys.argv)
  app.run(main)
