"""`launch.py`'s one call: start-up, check, train, one line for any stop.

`main(config, argv, workdir, distributed)` joins a multi-host run where one
is named, builds the config's parts (`build.parts`: checking a config is
building it), prints the run's first line, trains (`trainer.train`) and
prints the summary. Anything that stops a run (a bad value, a workdir in
use, a checkpoint that cannot be written, a lost peer process) ends the
process with one `launch.py: error: ...` line and a non-zero exit status.
"""

import datetime
import faulthandler
import functools
import logging as py_logging
import os
import sys
import threading
from typing import Any, NamedTuple, Sequence

from absl import flags
from absl import logging
import ml_collections

from stalepipe.train import prelude

error = prelude.error


class Distributed(NamedTuple):
  """The multi-host flags (all None: single process, or found in the
  environment of a SLURM/MPI job)."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  init_timeout: int
  heartbeat_timeout: int


class _LibraryErrors(py_logging.Filter):
  """Drops orbax's (and its asyncio tasks') own error logs: the launcher
  reports each failure once."""

  def filter(self, record):
    return not (("orbax" in record.pathname or record.name == "asyncio")
                and record.levelno <= py_logging.ERROR)


def _quiet_unraisable(unraisable) -> None:
  """Drops only tensorstore's callbacks into orbax's closed event loop after
  a failed save (the failure itself is reported once, by the launcher);
  every other unraisable exception is reported as Python would."""
  where = repr(unraisable.object) + str(unraisable.exc_value)
  if "Event loop is closed" in where or "tensorstore" in where:
    return
  sys.__unraisablehook__(unraisable)


def quiet_logs() -> None:
  """Library logs from warnings up, unless --verbosity was given."""
  if flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(logging.WARNING)
  for logger in (logging.get_absl_logger(), py_logging.getLogger("asyncio")):
    logger.addFilter(_LibraryErrors())
  sys.unraisablehook = _quiet_unraisable


def check_workdir(workdir: str) -> None:
  """A directory there, or a writable place to make one (the trainer makes
  it once the run is built)."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    error(f"--workdir={workdir} is invalid: it is a file; valid: a "
          "directory, or a path to create one at")
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    error(f"--workdir={workdir} is invalid: {parent} is a file; valid: a "
          "path under a directory")
  probe = os.path.join(parent, f".launch-probe-{os.getpid()}")
  try:  # os.access says yes to root on a read-only file system
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    error(f"--workdir={workdir} is invalid: {parent} is not writable "
          f"({e.strerror}); valid: a writable directory")


def _others(process_id, num_processes) -> str:
  others = [str(i) for i in range(num_processes or 0) if i != process_id]
  if len(others) == 1:
    return f"process {others[0]}"
  return f"one of processes {', '.join(others)}" if others else "a process"


def _check_address(address: str) -> None:
  """HOST:PORT with a port in 1..65535, before JAX tries to reach it."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    error(f"--coordinator_address={address} is invalid; valid: HOST:PORT "
          "with a port in 1..65535, e.g. 10.0.0.1:12345")


def _check_platform() -> None:
  """The devices JAX finds; one line where the platform asked for has none."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.devices()
  except RuntimeError as e:
    asked = os.environ.get("JAX_PLATFORMS", "")
    error(f"JAX_PLATFORMS={asked!r} is invalid here: "
          f"{str(e).splitlines()[0][:200]}; valid: a platform this machine "
          "has (cpu, cuda, ...), or unset")


def initialize_distributed(d: Distributed) -> None:
  """Joins a multi-process run when the flags or the environment name one.

  Must run before JAX touches a device. A process that has not met all the
  others within `d.init_timeout` stops with one line naming the missing
  one, before JAX's own deadline would abort it with a C++ dump.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from stalepipe.train import jax_private  # pylint: disable=g-import-not-at-top
  from stalepipe.train import peers  # pylint: disable=g-import-not-at-top
  given = (d.coordinator_address, d.num_processes, d.process_id)
  if all(v is None for v in given):
    if not prelude.cluster_environment():
      return
  elif any(v is None for v in given):
    error("--coordinator_address, --num_processes and --process_id are "
          "invalid alone; valid: all three, or none (found in a SLURM/MPI "
          "environment)")
  elif d.num_processes < 1:
    error(f"--num_processes={d.num_processes} is invalid; valid: >= 1")
  elif not 0 <= d.process_id < d.num_processes:
    error(f"--process_id={d.process_id} is invalid; valid: 0 to "
          f"{d.num_processes - 1}")
  else:
    _check_address(d.coordinator_address)
  # CPU processes talk over gloo; GPUs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if not flags.FLAGS["verbosity"].present:
    faulthandler.disable()  # absl's: a thread dump per process on an abort
    jax_private.quiet_native_logs()
  joined = threading.Event()

  def watchdog():
    if not joined.wait(d.init_timeout):
      error(f"process {d.process_id} of {d.num_processes}: "
            f"{_others(d.process_id, d.num_processes)} did not join the "
            f"coordinator at {d.coordinator_address} within "
            f"{d.init_timeout} s (--distributed_init_timeout); start every "
            "process with the same --coordinator_address and --num_processes")

  if d.process_id is not None:
    threading.Thread(target=watchdog, daemon=True).start()
  try:
    # JAX's own deadline comes later than the watchdog's, which speaks first.
    jax.distributed.initialize(
        *given, initialization_timeout=d.init_timeout + 30,
        heartbeat_timeout_seconds=d.heartbeat_timeout,
        shutdown_timeout_seconds=d.heartbeat_timeout)
  except Exception as e:  # pylint: disable=broad-except
    error(f"joining the multi-host run at {d.coordinator_address} failed: "
          f"{type(e).__name__}: {e}")
  joined.set()
  peers.watch(d.heartbeat_timeout, error)


def failure(e: BaseException) -> str:
  """One line for an exception that stopped the run."""
  import jax  # pylint: disable=g-import-not-at-top
  from stalepipe.train import checkpoint  # pylint: disable=g-import-not-at-top
  if isinstance(e, (ValueError, checkpoint.CheckpointError)):
    return str(e)
  if isinstance(e, OSError):
    if e.filename:
      return f"writing {e.filename} failed: {e.strerror or e}"
    return f"{e.strerror or e}"
  if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
    me = jax.process_index()
    return (f"process {me} of {jax.process_count()} lost contact with "
            f"{_others(me, jax.process_count())}, which stopped or crashed "
            f"(see its own output): {' '.join(str(e).split())[:200]}")
  if isinstance(e, KeyboardInterrupt):
    return "interrupted before training started; nothing was saved"
  return f"{type(e).__name__}: {e}"


def _report(summary: dict[str, Any], workdir: str) -> None:
  if "preempted" in summary:
    sys.exit(f"launch.py: stopped by {summary['preempted']} at step "
             f"{summary['steps']}; checkpoint {summary['checkpoint']}; run "
             "the same command again to resume")
  early = summary.get("stopped_early")
  if summary.get("already_finished"):
    print(f"nothing to do: the run in {workdir} already ended at step "
          f"{summary['steps']} " + (
              f"(stopped early: {early}; summary.json kept)" if early else
              "(summary.json kept; raise --config.num_steps to continue it)"))
  elif early:
    print(f"stopped early at step {summary['steps']}: {early}")
  print(f"test loss {summary['test_loss']:.4f}  test accuracy "
        f"{summary['test_accuracy']:.2%}  "
        f"{summary['steps_per_s']:.1f} steps/s training  "
        f"({summary['steps']} steps)  workdir {workdir}")


def main(config, argv: Sequence[str], workdir: str | None,
         distributed: Distributed, fresh: bool = False) -> None:
  """Starts, checks, trains and reports one run (see the module)."""
  quiet_logs()
  if not isinstance(config, ml_collections.ConfigDict):
    error(f"config file {prelude.config_arg(argv)[0]}: get_config returned "
          f"{type(config).__name__}; valid: a ConfigDict "
          "(ml_collections.ConfigDict(d) wraps a dict)")
  if workdir == "":
    error("--workdir= is invalid: empty; valid: a directory path, or no "
          "--workdir for a new one under runs/")
  workdir = workdir or os.path.join(
      "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
  initialize_distributed(distributed)
  _check_platform()
  import jax  # pylint: disable=g-import-not-at-top
  from stalepipe.train import build  # pylint: disable=g-import-not-at-top
  from stalepipe.train import peers  # pylint: disable=g-import-not-at-top
  from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
  # What every process refuses alike, process 0 (the coordinator) leaves
  # last: leaving first, it takes the service from a peer not yet at its line.
  # A peer that did not refuse is not waited on past a minute.
  in_order = functools.partial(peers.refused,
                               min(distributed.init_timeout, 60.0))
  differ = peers.same_config(config.to_json(sort_keys=True),
                             distributed.init_timeout)
  if differ:
    error(differ, then=in_order)
  try:
    parts = build.parts(config)
  except ValueError as e:  # the same config: every process refuses
    error(e, then=in_order)
  if jax.process_index() == 0:
    check_workdir(workdir)
    print(f"config {prelude.config_name(argv)} (resolved: "
          f"{os.path.join(workdir, 'config.json')}), "
          f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices",
          flush=True)
  try:
    summary = trainer.train(parts, workdir, fresh=fresh)
  except BaseException as e:  # pylint: disable=broad-except
    error(failure(e))
  peers.done()
  _report(summary, workdir)
