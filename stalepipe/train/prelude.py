"""What `launch.py` does before JAX is imported: processes, devices, flags.

This module imports no JAX and no stalepipe (the launcher loads it by path),
so a multi-host parent that only watches its worker never starts JAX, and
the CPU device count is set before JAX reads it.

- `before_jax(argv)`: a multi-host process runs its work in a watched child
  (`supervise.py`); CPU runs get 8 emulated devices; native logs quiet.
- `define_config(argv)` and `parse_flags(argv)`: absl and ml_collections'
  `config_flags` parse the command line, once; whatever they refuse ends the
  process with one `launch.py: error: ...` line naming the bad value and
  what is valid (`explain`).
"""

import importlib.util
import os
import signal
import sys
from typing import Any, Callable, Sequence

from absl import flags
from absl import logging

# What terminals, cluster schedulers and users send to stop a job.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_HERE = os.path.dirname(os.path.abspath(__file__))
# configs/default.py of this checkout, relative to where the launcher runs.
DEFAULT_CONFIG = os.path.relpath(
    os.path.join(os.path.dirname(os.path.dirname(_HERE)), "configs",
                 "default.py"))


def error(message: Any, code: int = 1,
          then: Callable[[], None] | None = None):
  """Prints `launch.py: error: message` and ends the process at once.

  `os._exit`: no interpreter teardown, so no library thread (orbax's, JAX's
  distributed client waiting on a dead peer) can keep it alive or dump.

  Args:
    message: the one line.
    code: the exit status.
    then: runs after the line is out and before the exit (e.g. leaving a
      multi-process run in order, `peers.refused`).
  """
  sys.stdout.flush()
  sys.stderr.write(f"launch.py: error: {' '.join(str(message).split())}\n")
  sys.stderr.flush()
  if then is not None:
    try:
      then()
    except Exception:  # pylint: disable=broad-except
      pass  # the line is out; leave anyway
  os._exit(code)  # pylint: disable=protected-access


def _by_path(name: str):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(_HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def cluster_environment() -> bool:
  """Whether SLURM, Open MPI or JAX's variables describe a multi-process job."""
  sizes = (os.environ.get("SLURM_NTASKS", "1"),
           os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
  return (any(size != "1" for size in sizes)
          or "JAX_COORDINATOR_ADDRESS" in os.environ)


def _supervise(argv: Sequence[str]) -> None:
  """A multi-host process runs its work in a child that it watches, so that
  a lost coordinator ends it with one line (`supervise.py`); returns in that
  child, or where the run is not multi-host."""
  supervise = _by_path("supervise")
  named = {a.split("=", 1)[0]: a.split("=", 1)[-1] for a in argv}
  multi = any(k in named for k in ("--coordinator_address", "--num_processes",
                                   "--process_id"))
  if supervise.is_worker():
    supervise.die_with_parent()
    return
  if not (multi or cluster_environment()):
    return
  me = named.get("--process_id", os.environ.get(
      "SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "?")))
  count = named.get("--num_processes", os.environ.get(
      "SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "?")))
  supervise.exit_as(
      supervise.run([sys.executable, *argv], f"process {me} of {count}"))


def before_jax(argv: Sequence[str], cpu_devices: int = 8) -> None:
  """Supervision, emulated CPU devices and quiet native logs, before JAX.

  The CPU platform gets `cpu_devices` devices unless XLA_FLAGS already sets
  a count; accelerators, where present, are used as they are. A multi-host
  run's C++ logs are kept from fatal up unless `--verbosity` is given: when
  a peer dies, JAX's coordination client logs its side of it in C++ while
  the launcher's one line says what happened.
  """
  _supervise(argv)
  for signum in STOP_SIGNALS:  # the trainer catches them once it trains
    signal.signal(signum, _stopped_before_training)
  if not any(a.startswith(("--verbosity", "-v=")) for a in argv):
    logging.set_verbosity(logging.ERROR)  # config_flags' warnings: one line
  flag = f"--xla_force_host_platform_device_count={cpu_devices}"
  if "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               + flag).strip()
  multi = any(a.startswith("--num_processes") for a in argv)
  if (multi or cluster_environment()) and not any(
      a.startswith(("--verbosity", "-v=")) for a in argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _stopped_before_training(signum, frame) -> None:
  del frame
  error(f"stopped by {signal.Signals(signum).name} before training started; "
        "nothing was saved")


def config_arg(argv: Sequence[str]) -> tuple[str, str | None]:
  """The `--config=PATH[:ARG]` of `argv` as (PATH, ARG)."""
  path, arg = DEFAULT_CONFIG, None
  for a in argv:
    if a.startswith("--config="):
      path, _, arg = a[len("--config="):].partition(":")
  return path, arg or None


def config_name(argv: Sequence[str]) -> str:
  path, arg = config_arg(argv)
  return path + (f":{arg}" if arg else "")


def define_config(argv: Sequence[str], define: Callable[[], Any]) -> Any:
  """`define()` (which defines the --config flag), one line if it fails.

  `config_flags` loads the default config and reads the command line's
  overrides as the flag is defined, so a bad file or key fails here.
  """
  try:
    return define()
  except BaseException as e:  # pylint: disable=broad-except
    error(explain(e, argv))


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing (an `app.run` flags_parser), one line if it fails;
  no positional arguments."""
  try:
    rest = flags.FLAGS(list(argv))
    _ = flags.FLAGS.config.keys()  # config_flags defers a failure to here
  except BaseException as e:  # pylint: disable=broad-except
    error(explain(e, argv))
  if len(rest) > 1:
    error(f"unexpected argument {rest[1]!r}; valid: flags only, e.g. "
          "--config=configs/default.py --config.num_steps=400 --workdir=DIR")
  return rest


# What a failed parse means, in one line. These run only after absl or
# config_flags has refused the command line.


def _load_config(argv: Sequence[str]) -> Any:
  """Runs the config file's `get_config`; any failure is one line."""
  path, arg = config_arg(argv)
  where = path + (f":{arg}" if arg else "")
  if not os.path.isfile(path):
    error(f"--config={path} is invalid: no such file; valid: a config file "
          "such as configs/default.py or configs/pipedream.py")
  try:
    spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      error(f"--config={path} is invalid: it defines no get_config(arg); "
            "valid: a config file such as configs/default.py")
    config = module.get_config(arg)
  except SyntaxError as e:
    error(f"config file {path} has a syntax error at line {e.lineno}: {e.msg}")
  except SystemExit as e:
    error(f"config file {where} called sys.exit({e.code}); valid: a "
          "get_config that returns a ConfigDict")
  except Exception as e:  # pylint: disable=broad-except
    error(f"config file {where} failed: {type(e).__name__}: {e}")
  if not hasattr(config, "keys"):
    error(f"config file {where}: get_config returned "
          f"{type(config).__name__}; valid: a ConfigDict")
  return config


def _override_value(argv, key: str, default):
  """The value `--config.key=` sets on the command line, else `default`."""
  for a in argv:
    if a.startswith(f"--config.{key}="):
      default = a.partition("=")[2]
  return default


def _unknown_kwarg(argv, config, key: str, field: str, part: str) -> str:
  """The line for `--config.<field>.<part>`, which the config does not set."""
  owner = field[:-len("_kwargs")]
  name = _override_value(argv, owner, config.get(owner))
  from stalepipe.train import validate  # pylint: disable=g-import-not-at-top
  keys = validate.accepted_keys(field, name)
  if keys is None:
    return (f"unknown config key {key!r}; valid keys here: "
            f"{', '.join(sorted(config[field].keys())) or 'none'}")
  if part not in keys:
    return (f"--config.{key} is invalid: {owner} {name!r} takes no {part!r}; "
            f"valid keys: {', '.join(keys) or 'none'}")
  return (f"--config.{key} is invalid here: {config_name(argv)} does not set "
          f"{field}.{part}, so the command line cannot; valid: set it in a "
          "config file (e.g. one that imports configs/default.py)")


def _value_line(key: str, text: str, leaf) -> str | None:
  """The line for a command-line value that does not parse as its type."""
  kinds = ((bool, ("True", "False", "true", "false", "1", "0"), "True or False"),
           (int, None, "an integer"), (float, None, "a number"))
  for kind, allowed, valid in kinds:
    if isinstance(leaf, kind):
      try:
        ok = text in allowed if allowed else kind(text) is not None
      except ValueError:
        ok = False
      return None if ok else f"{key}={text!r} is invalid; valid: {valid}"
  return None


def _override_line(argv) -> str | None:
  """The line for the first bad `--config.key=value` of `argv`, if any."""
  config = _load_config(argv)
  for a in argv:
    if not a.startswith("--config."):
      continue
    key, _, text = a[len("--config."):].partition("=")
    node, parent = config, None
    for part in key.split("."):
      if not hasattr(node, "keys"):
        return (f"unknown config key {key!r}: {type(node).__name__} has no "
                f"field {part!r}")
      if part not in node:
        if parent is not None and parent.endswith("_kwargs"):
          return _unknown_kwarg(argv, config, key, parent, part)
        return (f"unknown config key {key!r}; valid keys here: "
                f"{', '.join(sorted(node.keys()))}")
      node, parent = node[part], part
    line = _value_line(key, text, node)
    if line:
      return line
  return None


def explain(e: BaseException, argv: Sequence[str]) -> str:
  """One line for a command line that absl or config_flags refused."""
  text = " ".join(str(e).split())
  if type(e).__name__ == "FlagOrderError":
    return (f"{text}; valid: --config=FILE first, then its "
            "--config.key=value overrides")
  if isinstance(e, flags.UnrecognizedFlagError) and not text.startswith(
      "Unknown command line flag 'config."):
    return (f"{text}; valid: --config, --config.KEY=VALUE, --workdir and the "
            "flags `python launch.py --helpfull` lists")
  line = _override_line(argv)  # a bad file, key or value of the config
  if line:
    return line
  if isinstance(e, flags.IllegalFlagValueError) and text.startswith("flag --"):
    flag, _, why = text[len("flag "):].partition(": ")
    return f"{flag} is invalid: {why}"
  return f"{type(e).__name__}: {text}"
