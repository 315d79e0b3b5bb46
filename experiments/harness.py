"""What every benchmark shares: absl flags, interleaved repeats and medians,
one results convention.

A benchmark is a script with a `main(argv)` run by `harness.run(main)`:

  python experiments/<benchmark>.py [--repeats=N] [--out_dir=DIR] \
      [--write_figures] [its own flags]

- Flags are absl flags (`from absl import flags`), defined at module level.
- Timings compare variants within one run: `interleave({name: fn}, repeats)`
  calls the variants round-robin, so a noisy neighbour slows all of them
  alike, and `median` reads them.
- Results: `record(name, result)` prints the result as JSON and, with
  `--out_dir`, writes `<out_dir>/<name>.json`. Figures go into `--out_dir`
  as well (`figure_path`); into `docs/figures/` only with `--write_figures`.
- Bad flag values end the process with one `<script>: error: ...` line.

Example:

.. code-block:: python

  from absl import flags
  import harness

  _SIZE = flags.DEFINE_integer("size", 256, "Matrix size.")

  def main(argv):
    del argv
    times = harness.interleave({"a": lambda: ..., "b": lambda: ...})
    harness.record("my_benchmark", {k: harness.median(v)
                                    for k, v in times.items()})

  if __name__ == "__main__":
    harness.run(main)
"""

import glob
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, "docs", "figures")

REPEATS = flags.DEFINE_integer(
    "repeats", 5, "Rounds of interleaved timing; medians are reported.",
    lower_bound=1)
OUT_DIR = flags.DEFINE_string(
    "out_dir", None, "Directory for results (<name>.json) and figures; "
    "default: print only.")
WRITE_FIGURES = flags.DEFINE_bool(
    "write_figures", False, "Write figures into docs/figures/ (the ones the "
    "docs show) instead of --out_dir.")


def interleave(variants: dict[str, Callable[[], Any]],
               repeats: int | None = None) -> dict[str, list[float]]:
  """Seconds of each call of each variant, `repeats` rounds round-robin.

  Each variant is called once before timing (compilation, caches). A variant
  that returns a number of seconds itself (e.g. timed around a device sync)
  is recorded as it says; otherwise the wall time of the call is.
  """
  repeats = repeats or REPEATS.value
  for fn in variants.values():
    fn()
  times = {name: [] for name in variants}
  for _ in range(repeats):
    for name, fn in variants.items():
      start = time.perf_counter()
      result = fn()
      elapsed = time.perf_counter() - start
      times[name].append(result if isinstance(result, float) else elapsed)
  return times


def median(values) -> float:
  """The median of `values`."""
  return float(statistics.median(values))


def record(name: str, result: Any) -> str | None:
  """Prints `result` as JSON; writes `<out_dir>/<name>.json` if asked.

  Returns the path written, if any.
  """
  text = json.dumps(result, indent=2, default=float)
  print(text)
  if not OUT_DIR.value:
    return None
  os.makedirs(OUT_DIR.value, exist_ok=True)
  path = os.path.join(OUT_DIR.value, f"{name}.json")
  with open(path, "w") as f:
    f.write(text + "\n")
  return path


def workdirs(patterns: list[str]) -> list[str]:
  """The directories the globs `patterns` match, sorted, each once."""
  return sorted({path for pattern in patterns for path in glob.glob(pattern)
                 if os.path.isdir(path)})


def figure_path(name: str) -> str | None:
  """Where figure `name` (e.g. "sim_speed.png") goes: docs/figures/ with
  --write_figures, else --out_dir, else nowhere (None: draw nothing)."""
  if WRITE_FIGURES.value:
    return os.path.join(FIGURES, name)
  if OUT_DIR.value:
    os.makedirs(OUT_DIR.value, exist_ok=True)
    return os.path.join(OUT_DIR.value, name)
  return None


def _parse(argv: list[str]) -> list[str]:
  """absl's flag parsing; a bad flag is one line, and no positional
  arguments are taken."""
  script = os.path.basename(argv[0])
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"{script}: error: {' '.join(str(e).split())}")
  if len(rest) > 1:
    sys.exit(f"{script}: error: unexpected argument {rest[1]!r}; valid: "
             f"flags only (python {argv[0]} --helpfull)")
  return rest


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` with the harness's one-line flag errors."""
  app.run(main, flags_parser=_parse)
