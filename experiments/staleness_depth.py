"""Steps to a target validation loss against pipeline depth, and the slowdown.

  python experiments/staleness_depth.py --runs='runs/staleness_depth/*' \
      [--target_loss=L | --target_fraction=0.25] [--loss_at=96,192,288] \
      [--out_dir=DIR] [--write_figures] [--keep_to=DIR]

Reads the workdirs of configs/experiments/staleness_depth.py, named
`<method>-S<stages>-<seed>`. A run's steps to the target is where its
validation loss (`test_loss` in metrics.jsonl, every `eval_every` steps)
first falls to the target, linearly interpolated between that evaluation and
the one before it (the first evaluation itself if it is already there); a run
that never gets there is "not reached". For each (method, S) the steps are
the mean over seeds, and the slowdown is the mean over the seeds that both it
and the same method's S = 1 have, over S = 1's mean over those seeds (so a
cell of fewer seeds is never divided by other seeds' runs). A (method, S)
with a seed that did not reach the target has no mean: its slowdown is at
least (the steps it ran) / (S = 1's steps), written `>x`.

A rule of `SAME_AS_CONTROL_AT_ONE_STAGE` (PipeDream's stash and the
corrections that vanish without staleness) without S = 1 runs of its own
takes the control's (`1f1b`) at the same step size as its S = 1 cell: at one
stage it computes the same thing, bit for bit.

The default target is the worst of the S = 1 methods' validation losses at
`--target_fraction` of their training (each method's mean over seeds at the
last evaluation at or before that step), so every method reaches it at S = 1
by then, and a slowdown up to 1 / target_fraction can be measured.

Writes `staleness_depth.json` (harness.record), the markdown table
`staleness_depth.md` and `staleness_depth.png` (validation loss against
steps, one panel per rule with each depth at the rule's best rate there,
and the slowdown against S over the rule's best S = 1 cell; what it draws
is the JSON's "figure") into --out_dir; the figure into docs/figures/ with
--write_figures.

`--keep_to=DIR` first copies each finished or stopped run's record (its
config.json, metrics.jsonl and summary.json, and a stopped run's error line)
into `DIR/<name>/`, the layout this script reads, so the tables and figures
can be rebuilt from the records alone (the repository keeps the study's in
experiments/results/staleness_depth/). A record already there is left as it
is when it is the same run and refused when it is another.
"""

import filecmp
import json
import math
import os
import re
import shutil

from absl import flags
import numpy as np

import harness

_RUNS = flags.DEFINE_multi_string(
    "runs", None, "Workdir globs, e.g. 'runs/staleness_depth/*'.",
    required=True)
_TARGET_LOSS = flags.DEFINE_float(
    "target_loss", None, "Validation loss to reach; default: from the S = 1 "
    "runs and --target_fraction.")
_TARGET_FRACTION = flags.DEFINE_float(
    "target_fraction", 0.25, "Fraction of the S = 1 runs' steps at which "
    "the default target is read.", lower_bound=0.0, upper_bound=1.0)

_LOSS_AT = flags.DEFINE_list(
    "loss_at", [], "Steps at which to also tabulate each (method, S)'s "
    "validation loss, mean over seeds (the last evaluation at or before).")

_KEEP_TO = flags.DEFINE_string(
    "keep_to", None, "Copy each finished or stopped run's record "
    "(config.json, metrics.jsonl, summary.json) into DIR/<name>/ first.")

_NAME = re.compile(r"^(.+)-S(\d+)-(\d+)$")

# The control, and the rules whose run at S = 1 is the control's run at the
# same step size: with one stage nothing is stale, so their stash, prediction
# or correction leaves AdamW's update as it is. Their config-built runs at
# S = 1 train bit for bit like the control's
# (tests/staleness_depth_configs_test.py), so they need no S = 1 runs of
# their own. Not here: `dc` and `dc_asgd_ema` (equal to float rounding only:
# their correction is zero at S = 1, yet on some CPUs their weights differ
# from the control's in the last bits), `gap_aware` (weight decay 0),
# `sapipe_wp`, `zb_async` (stale at S = 1 too) and the rules with another
# optimizer.
CONTROL = "1f1b"
SAME_AS_CONTROL_AT_ONE_STAGE = ("pipedream", "pipemare", "spectrain",
                                "weight_pred")
_NAN_STOP = re.compile(r"launch.py: error: loss is -?(nan|inf)")


def _num_steps(workdir: str) -> int | None:
  """The run's `num_steps` from its config.json (None without one)."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      return json.load(f).get("num_steps")
  except FileNotFoundError:
    return None


def read_curve(workdir: str) -> tuple[np.ndarray, np.ndarray]:
  """`(steps, validation losses)` of a run's metrics.jsonl, by step: the
  mid-run evaluations only. The one at `num_steps` is taken on the drained
  weights (every in-flight minibatch applied), another kind of point."""
  curve, drained = {}, _num_steps(workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for record in map(json.loads, filter(str.strip, f)):
      if "test_loss" in record and record["step"] != drained:
        curve[record["step"]] = record["test_loss"]
  steps = sorted(curve)
  return np.array(steps, float), np.array([curve[s] for s in steps], float)


def steps_to_target(steps: np.ndarray, losses: np.ndarray,
                    target: float) -> float | None:
  """The step where `losses` first falls to `target`, linearly interpolated
  from the evaluation before; None if it never does.

  Examples:
    >>> steps_to_target(np.array([10., 20., 30.]), np.array([3., 2., 1.]), 1.5)
    25.0
  """
  below = np.flatnonzero(losses <= target)
  if not below.size:
    return None
  i = below[0]
  if i == 0:
    return float(steps[0])
  s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
  return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))


def loss_at(steps: np.ndarray, losses: np.ndarray, step: float) -> float:
  """The loss at the last evaluation at or before `step` (the first one if
  none is)."""
  return float(losses[max(np.searchsorted(steps, step, side="right") - 1,
                          0)])


def _status(workdir: str) -> tuple[str, str | None]:
  """("done", None) for a run with summary.json; ("diverged", line) for one
  the launcher stopped, with its `loss is nan/inf` line of `<workdir>.err`;
  ("unfinished", None) otherwise (running or killed)."""
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return "done", None
  try:
    with open(os.path.normpath(workdir) + ".err") as f:
      line = next((line for line in f if _NAN_STOP.search(line)), None)
  except FileNotFoundError:
    line = None
  return ("diverged", line) if line else ("unfinished", None)


def load(workdirs: list[str]) -> dict[tuple[str, int], dict[int, dict]]:
  """{(method, S): {seed: {"status", "steps", "losses"}}}; status is "done",
  "diverged" (the launcher stopped on a NaN/inf loss) or "unfinished"."""
  runs = {}
  for workdir in workdirs:
    match = _NAME.match(os.path.basename(os.path.normpath(workdir)))
    if not match:
      continue
    status, _ = _status(workdir)
    steps, losses = (read_curve(workdir) if status != "unfinished"
                     else (np.zeros(0), np.zeros(0)))
    runs.setdefault((match[1], int(match[2])), {})[int(match[3])] = {
        "status": status, "steps": steps, "losses": losses}
  return runs


RECORD_FILES = ("config.json", "metrics.jsonl", "summary.json")


def _record_files(workdir: str) -> list[str]:
  """The `RECORD_FILES` that `workdir` holds, in that order."""
  return [f for f in RECORD_FILES if os.path.exists(os.path.join(workdir, f))]


def keep(workdirs: list[str], dest: str) -> dict[str, list[str]]:
  """Copies each finished or stopped run of `workdirs` into `dest/<name>/`
  (`RECORD_FILES`, and a stopped run's `launch.py: error:` line as
  `dest/<name>.err`); returns {"kept", "same", "unfinished"}: the names
  copied, those already there as they are, those not copied (still running
  or killed: no record to keep).

  Raises:
    ValueError: `dest/<name>` holds another run's record (it is never
      overwritten).
  """
  done = {"kept": [], "same": [], "unfinished": []}
  for workdir in workdirs:
    name = os.path.basename(os.path.normpath(workdir))
    if not _NAME.match(name):
      continue
    target = os.path.join(dest, name)
    if os.path.abspath(target) == os.path.abspath(workdir):
      continue
    status, error = _status(workdir)
    if status == "unfinished":
      done["unfinished"].append(name)
      continue
    files = _record_files(workdir)
    if os.path.isdir(target):
      same = files == _record_files(target) and all(
          filecmp.cmp(os.path.join(workdir, f), os.path.join(target, f),
                      shallow=False) for f in files)
      if not same:
        raise ValueError(f"--keep_to: {target} holds another run's record "
                         f"than {workdir}; valid: a DIR without <name>/ or "
                         "with the same run's (move the old record away)")
      done["same"].append(name)
      continue
    os.makedirs(target)
    for f in files:
      shutil.copyfile(os.path.join(workdir, f), os.path.join(target, f))
    if error is not None:
      with open(target + ".err", "w") as f:
        f.write(error)
    done["kept"].append(name)
  return done


def control_at_one_stage(runs) -> list[str]:
  """Gives each method of `SAME_AS_CONTROL_AT_ONE_STAGE` without S = 1 runs
  of its own the control's S = 1 runs at its step size (in place); returns
  the methods given them.

  Examples:
    >>> runs = {("1f1b@3e-3", 1): {0: "run"}, ("pipedream@3e-3", 8): {}}
    >>> control_at_one_stage(runs), runs[("pipedream@3e-3", 1)]
    (['pipedream@3e-3'], {0: 'run'})
  """
  given = []
  for method, _ in list(runs):
    rule, sep, rate = method.partition("@")
    control = runs.get((CONTROL + sep + rate, 1))
    if (rule in SAME_AS_CONTROL_AT_ONE_STAGE and control
        and (method, 1) not in runs):
      runs[method, 1] = control
      given.append(method)
  return sorted(given)


def default_target(runs, fraction: float) -> float:
  """The worst S = 1 method's mean validation loss at `fraction` of its
  runs' steps."""
  worst = []
  for (method, stages), seeds in runs.items():
    done = [r for r in seeds.values() if r["status"] == "done"]
    if stages == 1 and done:
      worst.append(np.mean([loss_at(r["steps"], r["losses"],
                                    fraction * r["steps"][-1])
                            for r in done]))
  if not worst:
    raise SystemExit("staleness_depth.py: error: no finished S=1 run to "
                     "choose a target from; valid: pass --target_loss")
  return float(max(worst))


def table(runs, target: float) -> dict[str, dict[int, dict]]:
  """{method: {S: {"seeds", "steps" (mean or None), "at_least" (the fewest
  steps run by a seed that did not reach it, or None), "per_seed" (each
  seed's steps, None where it did not reach it), "slowdown",
  "slowdown_at_least", "slowdown_seeds"}}} over the runs that finished or
  diverged; the slowdowns are over the seeds the cell shares with S = 1."""
  rows, reached, missed = {}, {}, {}  # missed: the steps a seed ran
  for (method, stages), seeds in sorted(runs.items()):
    ended = {s: r for s, r in seeds.items() if r["status"] != "unfinished"}
    if not ended:
      continue
    mine = reached[method, stages] = {
        s: steps_to_target(r["steps"], r["losses"], target)
        for s, r in ended.items()}
    short = missed[method, stages] = {
        s: float(ended[s]["steps"][-1]) if ended[s]["steps"].size else 0.0
        for s, v in mine.items() if v is None}
    rows.setdefault(method, {})[stages] = {
        "seeds": sorted(ended),
        "steps": None if short else float(np.mean(list(mine.values()))),
        "at_least": min(short.values()) if short else None,
        "per_seed": {s: mine[s] for s in sorted(mine)}}
  for method, row in rows.items():
    base = reached.get((method, 1), {})
    for stages, cell in row.items():
      shared = sorted(set(cell["seeds"]) & set(base))
      base_steps = [base[s] for s in shared]
      ok = bool(shared) and None not in base_steps
      steps = [reached[method, stages][s] for s in shared]
      short = [missed[method, stages][s] for s in shared
               if s in missed[method, stages]]
      mean_base = float(np.mean(base_steps)) if ok else None
      cell["slowdown_seeds"] = shared if ok else []
      cell["slowdown"] = (float(np.mean(steps)) / mean_base
                          if ok and not short else None)
      cell["slowdown_at_least"] = (min(short) / mean_base
                                   if ok and short else None)
  return rows


def _cell(cell: dict | None) -> str:
  if cell is None:
    return "-"
  if cell["steps"] is None:
    bound = (f" (>{cell['slowdown_at_least']:.2f}x)"
             if cell["slowdown_at_least"] is not None else "")
    return f">{cell['at_least']:.0f}{bound}"
  ratio = (f" ({cell['slowdown']:.2f}x)" if cell["slowdown"] is not None
           else "")
  steps = list(cell["per_seed"].values())
  spread = (f" [{min(steps):.0f}-{max(steps):.0f}]" if len(steps) > 1
            else "")
  return f"{cell['steps']:.0f}{spread}{ratio}"


def _seeds(row: dict) -> str:
  counts = sorted({len(cell["seeds"]) for cell in row.values()})
  return "/".join(map(str, counts))


def markdown(rows, target: float) -> str:
  """`| method | S=1 | S=2 | ... |`: steps to the target (slowdown)."""
  stages = sorted({s for row in rows.values() for s in row})
  lines = [f"Steps to validation loss {target:.4f}: the mean over seeds [the "
           "fewest-most of one seed] (slowdown over S=1 on the same seeds; "
           "which seeds per cell in the JSON)", "",
           "| method | seeds | " + " | ".join(f"S={s}" for s in stages) + " |",
           "|---|---:|" + "---:|" * len(stages)]
  for method, row in rows.items():
    lines.append(f"| {method} | {_seeds(row)} | " +
                 " | ".join(_cell(row.get(s)) for s in stages) + " |")
  return "\n".join(lines)


def losses_at(runs, steps: list[int]) -> str:
  """Markdown: `| method | S | seeds | loss at each step |`, the mean over
  the finished seeds (`loss_at`), "-" where a seed ran fewer steps."""
  lines = ["Validation loss (mean over seeds)", "",
           "| method | S | seeds | " + " | ".join(f"step {s}" for s in steps)
           + " |", "|---|---:|---:|" + "---:|" * len(steps)]
  for (method, stages), seeds in sorted(runs.items()):
    done = [r for r in seeds.values() if r["status"] == "done"]
    if not done:
      continue
    cells = []
    for step in steps:
      at = [loss_at(r["steps"], r["losses"], step) for r in done
            if r["steps"][-1] >= step]
      cells.append(f"{np.mean(at):.3f}" if len(at) == len(done) else "-")
    lines.append(f"| {method} | {stages} | {len(done)} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def _rule_and_rate(method: str) -> tuple[str, str]:
  """`"pipedream@3e-3"` -> `("pipedream", "3e-3")`; no `@`: the config's rate."""
  rule, _, rate = method.partition("@")
  return rule, rate or "config"


def _method(rule: str, rate: str) -> str:
  """The inverse of `_rule_and_rate`: `("pipedream", "3e-3")` ->
  `"pipedream@3e-3"`; the config's rate: the rule alone."""
  return rule if rate == "config" else f"{rule}@{rate}"


def _rate_order(rate: str) -> tuple[bool, float]:
  """Rates in numeric order ("3e-3" before "1e-2"), the config's last."""
  return rate == "config", 0.0 if rate == "config" else float(rate)


def _rank(runs, rows, method: str, stages: int,
          seeds) -> tuple[float, float]:
  """A cell's rank among rates on `seeds`: its mean steps to the target over
  them (inf if one missed it), then its mean last validation loss over them
  (inf for a seed that diverged)."""
  cell = rows[method][stages]
  steps = [cell["per_seed"][s] for s in seeds]
  ended = runs[method, stages]
  last = [ended[s]["losses"][-1] if ended[s]["status"] == "done"
          and ended[s]["losses"].size else math.inf for s in seeds]
  return (math.inf if None in steps else float(np.mean(steps)),
          float(np.mean(last)))


def compared_seeds(rows, methods, stages: int) -> list[int]:
  """The seeds every one of `methods` (rates of one rule, each run at
  `stages`) has there; empty where they share none."""
  return sorted(set.intersection(*(set(rows[m][stages]["seeds"])
                                   for m in methods)))


def _pairs(rows, here: dict[str, str], stages: int) -> dict[str, list[int]]:
  """{"<rate>/<rate>": the seeds both ran at `stages`} for every pair of
  `here`'s rates, in rate order."""
  rates = sorted(here, key=_rate_order)
  return {f"{a}/{b}": compared_seeds(rows, (here[a], here[b]), stages)
          for i, a in enumerate(rates) for b in rates[i + 1:]}


def _best_rate(runs, rows, here: dict[str, str], stages: int,
               pairs: dict[str, list[int]]) -> str:
  """The rate that wins most comparisons with the others, each pair ranked
  (`_rank`) on the seeds both ran, or each on its own seeds where they share
  none; equal wins: the most seeds, then the best `_rank` on its own seeds,
  then the smaller rate. So two rates with three seeds each are told apart
  on all three, never on the one seed a third rate shares with them."""
  wins = dict.fromkeys(here, 0)
  for pair, seeds in pairs.items():
    a, b = pair.split("/")
    rank_a, rank_b = (_rank(runs, rows, here[r], stages,
                            seeds or rows[here[r]][stages]["seeds"])
                      for r in (a, b))
    if rank_a != rank_b:
      wins[a if rank_a < rank_b else b] += 1
  return min(sorted(here, key=_rate_order), key=lambda r: (
      -wins[r], -len(rows[here[r]][stages]["seeds"]),
      _rank(runs, rows, here[r], stages, rows[here[r]][stages]["seeds"])))


def best_rates(runs, rows) -> dict[str, dict]:
  """{rule: {"rates", "at_s1" (the rate ranked first at S = 1), "per_depth"
  {S: the rate ranked first at S, `_best_rate`}, "run_at" {S: the rates run
  at S}, "compared_seeds" {S: {"<rate>/<rate>": the seeds that pair was
  ranked on, `_pairs`}}}, over the methods named `<rule>@<rate>` (a method
  without `@` is its own rule at one rate). Where "run_at" has one rate of
  several in "rates", "per_depth" is that rate, a best of one."""
  rules = {}
  for method in rows:
    rule, rate = _rule_and_rate(method)
    rules.setdefault(rule, {})[rate] = method
  out = {}
  for rule, methods in sorted(rules.items()):
    depths = sorted({s for m in methods.values() for s in rows[m]})
    best, run_at, compared = {}, {}, {}
    for s in depths:
      here = {r: m for r, m in methods.items() if s in rows[m]}
      run_at[s] = sorted(here, key=_rate_order)
      compared[s] = _pairs(rows, here, s)
      best[s] = _best_rate(runs, rows, here, s, compared[s])
    out[rule] = {"rates": sorted(methods, key=_rate_order),
                 "at_s1": best.get(1), "per_depth": best, "run_at": run_at,
                 "compared_seeds": compared}
  return out


def rates_markdown(rows, rates, figure, target: float) -> str:
  """Two tables: each rule at its best S = 1 rate, and at its best rate at
  each depth (the rate in the cell; the slowdown over the rule's best S = 1
  cell, `figure_cells`'s, which `figure` holds). A rate that is the only one
  of the rule's grid run at a depth says so ("only rate run"): it is no best
  of several."""
  stages = sorted({s for row in rows.values() for s in row})
  head = ("| rule | rates | " + " | ".join(f"S={s}" for s in stages) + " |",
          "|---|---|" + "---:|" * len(stages))
  at_s1 = [f"Steps to validation loss {target:.4f} at each rule's best S=1 "
           "rate (in brackets after the rule)", "", *head]
  per_depth = [f"Steps to validation loss {target:.4f} at each rule's best "
               "rate per depth (@rate; slowdown over the rule's best S=1 "
               "cell)", "", *head]
  notes = []
  for rule, info in rates.items():
    grid = ", ".join(info["rates"])
    alone = {s for s, run in info["run_at"].items()
             if len(run) == 1 < len(info["rates"])}
    if info["at_s1"] is not None:
      method = _method(rule, info["at_s1"])
      label = info["at_s1"] + ", only rate run" * (1 in alone)
      at_s1.append(f"| {rule} ({label}) | {grid} | " + " | ".join(
          _cell(rows[method].get(s)) for s in stages) + " |")
    shown = {c["stages"]: c for c in figure[rule]}
    cells = []
    for s in stages:
      if s not in shown:
        cells.append("-")
        continue
      rate, cell = shown[s]["rate"], rows[shown[s]["method"]][s]
      text = _cell(cell).split(" (")[0]
      if shown[s]["slowdown"] is not None:
        text += f" ({shown[s]['slowdown']:.2f}x)"
      cells.append(f"{text} @{rate}" + " (only rate run)" * (s in alone))
      pairs = {p: seeds for p, seeds in info["compared_seeds"][s].items()
               if rate in p.split("/") and seeds != cell["seeds"]}
      if pairs:
        notes.append(f"{rule} at S={s}: " + ", ".join(
            f"{p} on " + ("seed" + "s" * (len(seeds) > 1) + " "
                          + " ".join(map(str, seeds)) if seeds
                          else "their own seeds (none shared)")
            for p, seeds in pairs.items()))
    per_depth.append(f"| {rule} | {grid} | " + " | ".join(cells) + " |")
  return "\n".join(at_s1 + [""] + per_depth + (
      ["", "Rates compared two at a time on the seeds both ran (fewest mean "
       "steps, then the lowest mean last loss); the cell is the rate with "
       "the most wins, at its mean over all its seeds. Where the cell's rate "
       "was compared on fewer seeds than the cell has: " + "; ".join(notes)
       + "."] if notes else []))


def reference_levels(workdirs: list[str]) -> dict[str, float]:
  """{"unigram", "bigram", "trigram"}: the cross-entropy (nats/byte) of the
  training split's n-gram models (`ngram.cross_entropy`, alpha 0.1) on the
  evaluation windows of the first run whose config.json names the stdlib
  data; {} if none does. The runs of one table share their data."""
  # Imported here: the package (and JAX) only when a table draws the levels.
  from stalepipe.data import ngram  # pylint: disable=g-import-not-at-top
  from stalepipe.data import stdlib_corpus  # pylint: disable=g-import-not-at-top
  for workdir in workdirs:
    try:
      with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    except FileNotFoundError:
      continue
    if config.get("dataset") != "stdlib":
      continue
    kwargs = {k: v for k, v in config["dataset_kwargs"].items()
              if k in ("seq_len", "stride", "test_fraction",
                       "max_test_windows", "cache_dir")}
    data = stdlib_corpus.stdlib(**kwargs)
    files = stdlib_corpus.stdlib_files(kwargs.get("test_fraction", 0.1))
    train, _ = stdlib_corpus.corpus_bytes(
        files, os.path.expanduser(kwargs.get("cache_dir",
                                             "~/.cache/stalepipe")))
    return {name: ngram.cross_entropy(train, data.x_test, data.y_test, order)
            for order, name in ((1, "unigram"), (2, "bigram"),
                                (3, "trigram"))}
  return {}


def figure_cells(rows, rates) -> dict[str, list[dict]]:
  """What the figure draws of each rule: {rule: [{"stages", "rate",
  "method", "slowdown", "at_least"}]}, one entry per depth at the rate
  `best_rates` ranked first there, in order of S. `slowdown` is the cell's
  mean steps to the target over the rule's best S = 1 cell's (as the
  per-depth table); where a seed missed the target, `at_least` is the
  fewest steps such a seed ran over it instead (a lower bound); both None
  without a finished S = 1 cell that reached it.

  Examples:
    >>> rows = {"r@1e-3": {1: {"steps": 20.0, "at_least": None},
    ...                    8: {"steps": None, "at_least": 90.0}},
    ...         "r@3e-3": {1: {"steps": 10.0, "at_least": None},
    ...                    8: {"steps": 40.0, "at_least": None}}}
    >>> rates = {"r": {"at_s1": "3e-3", "per_depth": {1: "3e-3", 8: "3e-3"}}}
    >>> [(c["stages"], c["rate"], c["slowdown"]) for c in
    ...  figure_cells(rows, rates)["r"]]
    [(1, '3e-3', 1.0), (8, '3e-3', 4.0)]
  """
  out = {}
  for rule, info in rates.items():
    base = None
    if info["at_s1"] is not None:
      base = rows[_method(rule, info["at_s1"])][1]["steps"]
    cells = []
    for stages, rate in sorted(info["per_depth"].items()):
      cell = rows[_method(rule, rate)][stages]
      ratio = bound = None
      if base:
        if cell["steps"] is not None:
          ratio = cell["steps"] / base
        elif cell["at_least"] is not None:
          bound = cell["at_least"] / base
      cells.append({"stages": stages, "rate": rate,
                    "method": _method(rule, rate), "slowdown": ratio,
                    "at_least": bound})
    out[rule] = cells
  return out


def plot(runs, cells, target: float, path: str, levels=None) -> None:
  """One panel per rule of `cells` (`figure_cells`): the validation loss of
  every seed at each depth, at the rule's best rate there (named in the
  legend), with the target and the reference `levels`; a last panel, the
  slowdown against S (log-log), hollow where it is a lower bound."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  panels, columns = len(cells) + 1, 4
  nrows = -(-panels // columns)
  fig, axes = plt.subplots(nrows, columns, figsize=(4.2 * columns,
                                                    3.6 * nrows),
                           squeeze=False)
  depth_color = plt.get_cmap("viridis")
  flat = list(axes.flat)
  for ax, (rule, rule_cells) in zip(flat, cells.items()):
    for cell in rule_cells:
      seeds = runs.get((cell["method"], cell["stages"]), {})
      for seed, r in sorted(seeds.items()):
        if r["steps"].size:
          ax.plot(r["steps"], r["losses"], lw=1,
                  color=depth_color(math.log2(cell["stages"]) / 5.5),
                  label=(f"S={cell['stages']} @{cell['rate']}"
                         if seed == min(seeds) else None))
    ax.axhline(target, color="grey", lw=0.8, ls="--", label="target")
    for (name, level), ls in zip((levels or {}).items(), (":", "-.", "--")):
      ax.axhline(level, color="tab:red", lw=0.8, ls=ls, label=name)
    ax.set(title=rule, xlabel="step", ylabel="validation loss (nats/byte)")
    ax.legend(fontsize=7)
  ax = flat[len(cells)]
  rule_color = plt.get_cmap("tab20")
  for i, (rule, rule_cells) in enumerate(cells.items()):
    color = rule_color(i % 20)
    reached = [(c["stages"], c["slowdown"]) for c in rule_cells
               if c["slowdown"] is not None]
    bounds = [(c["stages"], c["at_least"]) for c in rule_cells
              if c["at_least"] is not None]
    if reached:
      ax.plot(*zip(*reached), marker="o", color=color, label=rule)
    if bounds:
      ax.plot(*zip(*bounds), ls="none", marker="^", mfc="none", color=color,
              label=None if reached else f"{rule} (>)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set(xlabel="stages S", ylabel="steps to target / best S=1 cell's",
         title="slowdown (hollow: at least)")
  if ax.lines:
    ax.legend(fontsize=6, ncol=2)
  for ax in flat[panels:]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  if _KEEP_TO.value:
    try:
      kept = keep(harness.workdirs(_RUNS.value), _KEEP_TO.value)
    except ValueError as e:
      raise SystemExit(f"staleness_depth.py: error: {e}") from None
    print(f"kept {len(kept['kept'])} runs in {_KEEP_TO.value} "
          f"({len(kept['same'])} already there; not kept, unfinished: "
          f"{', '.join(kept['unfinished']) or 'none'})")
  runs = load(harness.workdirs(_RUNS.value))
  if not runs:
    raise SystemExit(f"staleness_depth.py: error: --runs={_RUNS.value} "
                     "matches no <method>-S<stages>-<seed> workdir")
  own = dict(runs)  # the loss table lists each run once
  from_control = control_at_one_stage(runs)
  target = (_TARGET_LOSS.value if _TARGET_LOSS.value is not None
            else default_target(runs, _TARGET_FRACTION.value))
  rows = table(runs, target)
  rates = best_rates(runs, rows)
  cells = figure_cells(rows, rates)
  levels = reference_levels(harness.workdirs(_RUNS.value))
  harness.record("staleness_depth", {"target_loss": target, "rows": rows,
                                     "best_rates": rates, "figure": cells,
                                     "reference_levels": levels,
                                     "s1_from_control": from_control})
  text = markdown(rows, target)
  if from_control:
    text += (f"\n\nS=1 of {', '.join(from_control)}: the {CONTROL} runs at the "
             "same rate (at one stage they compute what it computes)")
  if levels:
    text = ("Reference levels on the evaluation windows (n-gram models of the "
            "training split, nats/byte): " + ", ".join(
                f"{k} {v:.3f}" for k, v in levels.items()) + "\n\n" + text)
  if any(len(r["rates"]) > 1 for r in rates.values()):
    text += "\n\n" + rates_markdown(rows, rates, cells, target)
  if _LOSS_AT.value:
    text += "\n\n" + losses_at(own, [int(s) for s in _LOSS_AT.value])
  print(text)
  if harness.OUT_DIR.value:
    with open(os.path.join(harness.OUT_DIR.value, "staleness_depth.md"),
              "w") as f:
      f.write(text + "\n")
  path = harness.figure_path("staleness_depth.png")
  if path:
    plot(runs, cells, target, path, levels)


if __name__ == "__main__":
  harness.run(main)
