r"""Runs an experiment from a config file.

  python launch.py --config=configs/default.py[:variant=NAME] \
      [--config.key=value ...] [--workdir=DIR] [--verbosity=0]

With no flags it runs configs/default.py into a new directory under runs/. A
workdir holding a checkpoint is resumed. On several hosts, start one process
per host with the same flags plus

  --coordinator_address=HOST:PORT --num_processes=N --process_id=I

or none of them under SLURM (or another cluster `jax.distributed.initialize()`
detects), which then finds them in the environment.

The console shows where the resolved config is, one progress line, the
evaluations and the summary; library logs only from warnings up unless
`--verbosity` asks for more. Anything that stops a run (a bad value, a
checkpoint that cannot be written, a lost peer process) ends the process
with one `launch.py: error: ...` line and a non-zero exit status.
"""

import datetime
import faulthandler
import importlib.util
import logging as py_logging
import os
import sys
import threading

from absl import app
from absl import flags
from absl import logging
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
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_init_timeout", 120, "Seconds a multi-host run waits for all "
    "its processes to join before it stops, naming the missing one.",
    lower_bound=1)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "distributed_heartbeat_timeout", 60, "Seconds without a heartbeat after "
    "which JAX's coordinator takes a process of a multi-host run for dead "
    "(and aborts the others); the launcher stops them, naming it, after "
    "half of this.", lower_bound=2)


def _error(message: str, code: int = 1):
  """Prints `launch.py: error: message` and ends the process at once.

  `os._exit`: no interpreter teardown, so no library thread (orbax's, JAX's
  distributed client waiting on a dead peer) can keep it alive or dump.
  """
  sys.stdout.flush()
  sys.stderr.write(f"launch.py: error: {' '.join(str(message).split())}\n")
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _config_arg(argv) -> tuple[str, str | None]:
  path, arg = _DEFAULT_CONFIG, None
  for a in argv:
    if a.startswith("--config="):
      path, _, arg = a[len("--config="):].partition(":")
  return path, arg or None


def _load_config(argv):
  """Runs the config file's `get_config`; any failure is one line."""
  path, arg = _config_arg(argv)
  if not os.path.isfile(path):
    _error(f"--config={path} is invalid: no such file; valid: a config file "
           "such as configs/default.py or configs/pipedream.py")
  try:
    spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      _error(f"--config={path} is invalid: it defines no get_config(arg); "
             "valid: a config file such as configs/default.py")
    return module.get_config(arg)
  except SyntaxError as e:
    _error(f"config file {path} has a syntax error at line {e.lineno}: "
           f"{e.msg}")
  except Exception as e:  # pylint: disable=broad-except
    _error(f"config file {path}{':' + arg if arg else ''} failed: "
           f"{type(e).__name__}: {e}")


def _override(argv, key: str, default):
  """The value `--config.key=` sets on the command line, else `default`."""
  for a in argv:
    if a.startswith(f"--config.{key}="):
      default = a.partition("=")[2]
  return default


def _unknown_kwarg(argv, config, key: str, field: str, part: str):
  """One line for `--config.<field>.<part>`, which the config does not set."""
  from stalepipe.train import validate  # pylint: disable=g-import-not-at-top
  owner = field[:-len("_kwargs")]
  name = _override(argv, owner, config.get(owner))
  keys = validate.accepted_keys(field, name)
  if keys is None:
    _error(f"unknown config key {key!r}; valid keys here: "
           f"{', '.join(sorted(config[field].keys())) or 'none'}")
  if part not in keys:
    _error(f"--config.{key} is invalid: {owner} {name!r} takes no {part!r}; "
           f"valid keys: {', '.join(keys) or 'none'}")
  _error(f"--config.{key} is invalid here: {config_arg_hint(argv)} does not "
         f"set {field}.{part}, so the command line cannot; valid: set it in "
         "a config file (e.g. one that imports configs/default.py)")


def config_arg_hint(argv) -> str:
  path, arg = _config_arg(argv)
  return path + (f":{arg}" if arg else "")


def _check_value(key: str, text: str, leaf):
  """A command-line value must parse as its field's type."""
  kinds = ((bool, ("True", "False", "true", "false", "1", "0"), "True or False"),
           (int, None, "an integer"), (float, None, "a number"))
  for kind, allowed, valid in kinds:
    if isinstance(leaf, kind):
      try:
        ok = text in allowed if allowed else kind(text) is not None
      except ValueError:
        ok = False
      if not ok:
        _error(f"{key}={text!r} is invalid; valid: {valid}")
      return


def _define_config_flag(argv):
  """Defines --config; a bad file, key or value exits with one line."""
  config = _load_config(argv)
  for a in argv:
    if not a.startswith("--config."):
      continue
    key, _, text = a[len("--config."):].partition("=")
    node, parent = config, None
    for part in key.split("."):
      if not hasattr(node, "keys"):
        _error(f"unknown config key {key!r}: {type(node).__name__} has no "
               f"field {part!r}")
      if part not in node:
        if parent is not None and parent.endswith("_kwargs"):
          _unknown_kwarg(argv, config, key, parent, part)
        _error(f"unknown config key {key!r}; valid keys here: "
               f"{', '.join(sorted(node.keys()))}")
      node, parent = node[part], part
    _check_value(key, text, node)
  return config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "Experiment config file.", lock_config=True)


def _emulate_cpu_devices(count: int = 8):
  """Gives the CPU platform `count` devices unless XLA_FLAGS already does.

  Must run before JAX is imported. Accelerators, where present, are used as
  they are.
  """
  flag = f"--xla_force_host_platform_device_count={count}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


class _LibraryErrors(py_logging.Filter):
  """Drops orbax's (and its asyncio tasks') own error logs: the launcher
  reports each failure once."""

  def filter(self, record):
    return not (("orbax" in record.pathname or record.name == "asyncio")
                and record.levelno <= py_logging.ERROR)


def _quiet_logs():
  """Library logs from warnings up, unless --verbosity was given."""
  if flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(logging.WARNING)
  for logger in (logging.get_absl_logger(), py_logging.getLogger("asyncio")):
    logger.addFilter(_LibraryErrors())
  # tensorstore's callbacks into orbax's closed event loop after a failed
  # save: the failure itself is reported once, by the launcher.
  sys.unraisablehook = lambda unraisable: None


def _check_workdir(workdir: str):
  """A directory there, or a writable place to make one (the trainer makes
  it once the run is built)."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    _error(f"--workdir={workdir} is invalid: it is a file; valid: a "
           "directory, or a path to create one at")
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    _error(f"--workdir={workdir} is invalid: {parent} is a file; valid: a "
           "path under a directory")
  probe = os.path.join(parent, f".launch-probe-{os.getpid()}")
  try:  # os.access says yes to root on a read-only file system
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    _error(f"--workdir={workdir} is invalid: {parent} is not writable "
           f"({e.strerror}); valid: a writable directory")


def _cluster_environment() -> bool:
  """Whether SLURM, Open MPI or JAX's variables describe a multi-process job."""
  sizes = (os.environ.get("SLURM_NTASKS", "1"),
           os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
  return (any(size != "1" for size in sizes)
          or "JAX_COORDINATOR_ADDRESS" in os.environ)


def _others(process_id, num_processes) -> str:
  others = [str(i) for i in range(num_processes or 0) if i != process_id]
  if len(others) == 1:
    return f"process {others[0]}"
  return f"one of processes {', '.join(others)}" if others else "a process"


def _initialize_distributed():
  """Joins a multi-process run when the flags or the environment name one.

  Must run before JAX touches a device. A process that has not met all the
  others within --distributed_init_timeout stops with one line naming the
  missing one, before JAX's own deadline would abort it with a C++ dump.
  """
  import jax  # pylint: disable=g-import-not-at-top
  given = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if all(v is None for v in given):
    if not _cluster_environment():
      return
  elif any(v is None for v in given):
    _error("--coordinator_address, --num_processes and --process_id are "
           "invalid alone; valid: all three, or none (found in a SLURM/MPI "
           "environment)")
  elif _NUM_PROCESSES.value < 1:
    _error(f"--num_processes={_NUM_PROCESSES.value} is invalid; valid: >= 1")
  elif not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
    _error(f"--process_id={_PROCESS_ID.value} is invalid; valid: 0 to "
           f"{_NUM_PROCESSES.value - 1}")
  # CPU processes talk over gloo; GPUs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if not flags.FLAGS["verbosity"].present:
    faulthandler.disable()  # absl's: a thread dump per process on an abort
    # C++ logs from fatal up (what TF_CPP_MIN_LOG_LEVEL=3 asks, which this
    # jaxlib's absl logging no longer reads; jax_logging_level does the same
    # but also re-levels the Python loggers): a lost peer's warnings and
    # errors from the coordination client would precede the one line.
    from jax._src.lib import utils  # pylint: disable=g-import-not-at-top
    utils.absl_set_min_log_level(3)
  timeout = _INIT_TIMEOUT.value
  joined = threading.Event()

  def watchdog():
    if not joined.wait(timeout):
      _error(f"process {_PROCESS_ID.value} of {_NUM_PROCESSES.value}: "
             f"{_others(_PROCESS_ID.value, _NUM_PROCESSES.value)} did not "
             f"join the coordinator at {_COORDINATOR.value} within {timeout} "
             "s (--distributed_init_timeout); start every process with the "
             "same --coordinator_address and --num_processes")

  if _PROCESS_ID.value is not None:
    threading.Thread(target=watchdog, daemon=True).start()
  try:
    # JAX's own deadline comes later than the watchdog's, which speaks first.
    jax.distributed.initialize(
        *given, initialization_timeout=timeout + 30,
        heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value,
        shutdown_timeout_seconds=_HEARTBEAT_TIMEOUT.value)
  except Exception as e:  # pylint: disable=broad-except
    _error(f"joining the multi-host run at {_COORDINATOR.value} failed: "
           f"{type(e).__name__}: {e}")
  joined.set()
  from stalepipe.train import peers  # pylint: disable=g-import-not-at-top
  peers.watch(_HEARTBEAT_TIMEOUT.value, _error)


def _failure(e: BaseException) -> str:
  """One line for an exception that stopped the run."""
  import jax  # pylint: disable=g-import-not-at-top
  from stalepipe.train import checkpoint  # pylint: disable=g-import-not-at-top
  if isinstance(e, (ValueError, checkpoint.CheckpointError)):
    return str(e)
  if isinstance(e, OSError):
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"
  if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
    me = jax.process_index()
    return (f"process {me} of {jax.process_count()} lost contact with "
            f"{_others(me, jax.process_count())}, which stopped or crashed "
            f"(see its own output): {' '.join(str(e).split())[:200]}")
  if isinstance(e, KeyboardInterrupt):
    return "interrupted before training started; nothing was saved"
  return f"{type(e).__name__}: {e}"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  _quiet_logs()
  _emulate_cpu_devices()
  config = flags.FLAGS.config
  try:
    from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
    from stalepipe.train import validate  # pylint: disable=g-import-not-at-top
    validate.check(config)
  except ValueError as e:
    _error(e)
  workdir = _WORKDIR.value or os.path.join(
      "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
  _initialize_distributed()
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    _check_workdir(workdir)
    config_path, arg = _config_arg(sys.argv)
    print(f"config {config_path}{':' + arg if arg else ''} (resolved: "
          f"{os.path.join(workdir, 'config.json')}), "
          f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices",
          flush=True)
  try:
    summary = trainer.train_and_evaluate(config, workdir)
  except BaseException as e:  # pylint: disable=broad-except
    _error(_failure(e))
  from stalepipe.train import peers  # pylint: disable=g-import-not-at-top
  peers.done()
  if "preempted" in summary:
    sys.exit(f"launch.py: stopped by {summary['preempted']} at step "
             f"{summary['steps']}; checkpoint {summary['checkpoint']}; run "
             "the same command again to resume")
  if summary.get("already_finished"):
    print(f"nothing to do: the run in {workdir} already ended at step "
          f"{summary['steps']} (summary.json kept; raise --config.num_steps "
          "to continue it)")
  print(f"final loss {summary['final_loss']:.4f}  test accuracy "
        f"{summary['test_accuracy']:.2%}  "
        f"{summary['steps_per_s']:.1f} steps/s  "
        f"({summary['steps']} steps in {summary['seconds']:.1f} s)  "
        f"workdir {workdir}")


def _quiet_native_logs(argv):
  """C++ logs of a multi-host run only from fatal up, unless --verbosity:
  when a peer dies, JAX's coordination client logs its side of it in C++
  while the launcher's one line says what happened."""
  multi = any(a.startswith("--num_processes") for a in argv)
  if (multi or _cluster_environment()) and not any(
      a.startswith(("--verbosity", "-v=")) for a in argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _supervise(argv) -> None:
  """A multi-host process runs its work in a child that it watches, so that
  a lost coordinator ends it with one line (`stalepipe/train/supervise.py`);
  returns in that child, or where the run is not multi-host."""
  # By path: importing the package would import JAX into this parent too.
  spec = importlib.util.spec_from_file_location(
      "supervise", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "stalepipe", "train", "supervise.py"))
  supervise = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(supervise)
  named = {a.split("=", 1)[0]: a.split("=", 1)[-1] for a in argv}
  multi = any(k in named for k in ("--coordinator_address", "--num_processes",
                                   "--process_id"))
  if supervise.is_worker():
    supervise.die_with_parent()
    return
  if not (multi or _cluster_environment()):
    return
  me = named.get("--process_id", os.environ.get(
      "SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "?")))
  count = named.get("--num_processes", os.environ.get(
      "SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "?")))
  supervise.exit_as(
      supervise.run([sys.executable, *argv], f"process {me} of {count}"))


if __name__ == "__main__":
  _supervise(sys.argv)
  _emulate_cpu_devices()  # before anything imports JAX
  _quiet_native_logs(sys.argv)
  _define_config_flag(sys.argv)
  app.run(main)
