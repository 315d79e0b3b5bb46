r"""Runs an experiment from a config file.

  python launch.py --config=configs/default.py [--config.key=value ...] \
      [--workdir=DIR]

With no flags it runs configs/default.py into a new directory under runs/.
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = flags.FLAGS.config
  _emulate_cpu_devices()
  from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
  workdir = _WORKDIR.value or os.path.join(
      "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
  print(config)
  try:
    summary = trainer.train_and_evaluate(config, workdir)
  except ValueError as e:
    sys.exit(f"launch.py: error: {e}")
  print(f"final loss {summary['final_loss']:.4f}  test accuracy "
        f"{summary['test_accuracy']:.2%}  {summary['steps_per_s']:.1f} steps/s  "
        f"({summary['steps']} steps in {summary['seconds']:.1f} s)  "
        f"workdir {workdir}")


if __name__ == "__main__":
  _define_config_flag(sys.argv)
  app.run(main)
