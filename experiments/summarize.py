"""Mean and std over seeds of launch.py runs, one table row per run name.

  python experiments/summarize.py --runs='runs/sapipe_table2/*' \
      [--keys=test_accuracy,final_training_loss] [--out_dir=DIR]

A run is a workdir named `<row>-<seed>`; runs that share `<row>` are one
row. Each value is the run's `summary.json` entry, or its `figures.json`
entry (written by a config's hook, `experiments/hooks.py`) where the summary
lacks the key. A run without `summary.json` whose launcher's stderr, saved
beside the workdir as `<row>-<seed>.err`, says "loss is nan" (or inf)
stopped on a diverged loss and is counted as diverged; one without either
is counted as unfinished; neither enters the mean. The std is over seeds
with ddof=0. `harness.record` prints the table's JSON (and writes
`<out_dir>/<name>.json`), then the markdown table follows.

`--curve=KEY` also draws each run's training loss (from `metrics.jsonl`,
a rolling mean of `--smooth` logged values) against the `metrics.jsonl`
key KEY logged at the same steps (e.g. `simulated_seconds`, which
`experiments.hooks:SimulatedSeconds` writes) into `<name>.png` under
--out_dir (docs/figures/ with --write_figures), one panel per prefix of the
row names before their last "-" (`hete-B-sdpipe` is row `sdpipe` of panel
`hete-B`).
"""

import json
import os
import re

from absl import flags
import numpy as np

import harness

_RUNS = flags.DEFINE_multi_string(
    "runs", None, "Workdir globs, e.g. 'runs/sapipe_table2/*' (repeatable).",
    required=True)
_KEYS = flags.DEFINE_list(
    "keys", ["test_accuracy", "final_training_loss"],
    "summary.json (or figures.json) keys to tabulate.")
_NAME = flags.DEFINE_string(
    "name", None, "Name of the results JSON; default: the first glob's "
    "directory name, e.g. sapipe_table2.")

_CURVE = flags.DEFINE_string(
    "curve", None, "A metrics.jsonl key to draw each run's training loss "
    "against (e.g. simulated_seconds); default: no figure.")
_SMOOTH = flags.DEFINE_integer(
    "smooth", 1, "Logged losses in the rolling mean of each --curve.",
    lower_bound=1)

_SEED = re.compile(r"^(.*)-(\d+)$")
_NAN_STOP = re.compile(r"launch.py: error: loss is -?(nan|inf)")


def row_and_seed(workdir: str) -> tuple[str, int | None]:
  """`runs/x/wp1-2` -> ("wp1", 2); a name without `-<seed>` is its own row.

  Examples:
    >>> row_and_seed("runs/sapipe_table2/wp1-2")
    ('wp1', 2)
  """
  name = os.path.basename(os.path.normpath(workdir))
  match = _SEED.match(name)
  return (match[1], int(match[2])) if match else (name, None)


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _diverged(workdir: str) -> bool:
  """Whether the launcher stopped the run on a NaN or inf loss."""
  try:
    with open(os.path.normpath(workdir) + ".err") as f:
      return bool(_NAN_STOP.search(f.read()))
  except FileNotFoundError:
    return False


def load(workdir: str) -> tuple[str, dict | None]:
  """("done", values), ("diverged", None) or ("unfinished", None)."""
  summary = _read_json(os.path.join(workdir, "summary.json"))
  if summary is None:
    return ("diverged" if _diverged(workdir) else "unfinished"), None
  figures = _read_json(os.path.join(workdir, "figures.json")) or {}
  return "done", {**figures, **summary}


def summarize(workdirs: list[str], keys: list[str]) -> dict[str, dict]:
  """Per row: seeds, values per key, mean and std (ddof=0) over the runs
  that finished, and how many diverged or did not finish."""
  rows = {}
  for workdir in workdirs:
    name, seed = row_and_seed(workdir)
    row = rows.setdefault(name, {"seeds": [], "diverged": [],
                                 "unfinished": [],
                                 "values": {k: [] for k in keys}})
    status, values = load(workdir)
    if status != "done":
      row[status].append(seed)
      continue
    row["seeds"].append(seed)
    for k in keys:
      value = values.get(k)
      if isinstance(value, (int, float)):
        row["values"][k].append(float(value))
  for row in rows.values():
    row["mean"] = {k: float(np.mean(v)) if v else None
                   for k, v in row["values"].items()}
    row["std"] = {k: float(np.std(v)) if v else None
                  for k, v in row["values"].items()}
  return rows


def _cell(mean: float | None, std: float | None) -> str:
  if mean is None:
    return "-"
  digits = 4 if abs(mean) < 100 else 0
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(rows: dict[str, dict], keys: list[str]) -> str:
  """`| run | seeds | key ... | diverged |`, one line per row."""
  lines = [f"| run | seeds | {' | '.join(keys)} | diverged |",
           "|---|---:|" + "---|" * len(keys) + "---:|"]
  for name, row in rows.items():
    cells = [_cell(row["mean"][k], row["std"][k]) for k in keys]
    stopped = str(len(row["diverged"]))
    if row["unfinished"]:
      stopped += f" (+{len(row['unfinished'])} unfinished)"
    lines.append(f"| {name} | {len(row['seeds'])} | {' | '.join(cells)} | "
                 f"{stopped} |")
  return "\n".join(lines)


def curve(workdir: str, key: str, smooth: int) -> tuple[np.ndarray,
                                                        np.ndarray]:
  """`(x, loss)`: each logged step's `key` and training loss (the rolling
  mean of `smooth` logged losses), where metrics.jsonl has both."""
  import hooks  # pylint: disable=g-import-not-at-top  (JAX: --curve only)
  x, loss = {}, {}
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for record in map(json.loads, filter(str.strip, f)):
        if key in record:
          x[record["step"]] = record[key]
        if "loss" in record:
          loss[record["step"]] = record["loss"]
  except FileNotFoundError:
    pass
  steps = sorted(set(x) & set(loss))
  return (np.array([x[s] for s in steps], float),
          hooks.rolling_mean([loss[s] for s in steps], smooth))


def plot(workdirs: list[str], key: str, smooth: int, path: str) -> None:
  """One panel per row-name prefix (before the last "-"), one line per run
  (per row and seed), loss on a log scale against `key`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = {}
  for workdir in workdirs:
    row, seed = row_and_seed(workdir)
    panel, _, label = row.rpartition("-")
    panels.setdefault(panel, []).append((label, seed, workdir))
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2),
                           sharey=True, squeeze=False)
  for ax, (panel, runs) in zip(axes[0], panels.items()):
    for label, seed, workdir in runs:
      x, loss = curve(workdir, key, smooth)
      if x.size:
        ax.plot(x, loss, label=label if seed in (None, 0) else
                f"{label}-{seed}")
    ax.set_yscale("log")
    ax.set_title(panel or os.path.basename(os.path.dirname(workdirs[0])))
    ax.set_xlabel(key)
  axes[0][0].set_ylabel(f"training loss (mean of {smooth} logged)")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  workdirs = harness.workdirs(_RUNS.value)
  if not workdirs:
    raise SystemExit(f"summarize.py: error: --runs={_RUNS.value} matches "
                     "no workdir")
  keys = _KEYS.value
  rows = summarize(workdirs, keys)
  name = _NAME.value or os.path.basename(os.path.dirname(
      os.path.normpath(workdirs[0]))) or "summary"
  harness.record(name, {"runs": _RUNS.value, "keys": keys, "rows": rows})
  png = _CURVE.value and harness.figure_path(f"{name}.png")
  if png:
    plot(workdirs, _CURVE.value, _SMOOTH.value, png)
  print(markdown(rows, keys))  # last, under the JSON


if __name__ == "__main__":
  harness.run(main)
