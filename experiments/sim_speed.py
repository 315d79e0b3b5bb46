"""Simulator speed at cluster scale: every sync policy, up to 4,096 workers.

Times `sp.sim.simulate` of a tiled 1F1B (4 stages, 4 micro-batches, hete-A
stragglers) on `P` pipelines x 4 stages:

- the table: 256 pipelines (1,024 workers) x `--minibatches` (10,000) for
  BSP, WSP (D=0, N_m=4), SDPipe (P=10, T=10 ms), AD-PSGD and local SGD (H=8);
- the curve: 4 to 1,024 pipelines (16 to 4,096 workers) x
  `--curve_minibatches` (1,000), every policy.

Each point runs in its own process pinned to one core (`taskset -c
--core`), and times `simulate` alone (the schedule is tiled first). With
`--before=DIR` (a `git worktree` of another commit) every point is also run
with that tree's `stalepipe`, the two sides interleaved repeat by repeat;
the JSON (sim_speed.json in `--out_dir`) holds every run and the medians;
the curve is drawn as sim_speed.png (`harness.figure_path`).

Usage:
  git worktree add --detach /tmp/sim_before <commit>
  .venv/bin/python experiments/sim_speed.py --out_dir=/tmp/sim_speed \\
      --before=/tmp/sim_before [--repeats=3] [--write_figures]
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags

import harness

_BEFORE = flags.DEFINE_string("before", None, "A worktree to time as "
                              "'before' (its stalepipe), interleaved.")
_CURVE_REPEATS = flags.DEFINE_integer("curve_repeats", 1,
                                      "Runs per point of the curve.")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 10_000,
                                    "Minibatches in the table.")
_CURVE_MINIBATCHES = flags.DEFINE_integer("curve_minibatches", 1_000,
                                          "Minibatches on the curve.")
_CURVE_PIPELINES = flags.DEFINE_list("curve_pipelines",
                                     ["4", "16", "64", "256", "1024"],
                                     "Pipelines (x 4 stages) on the curve.")
_POLICIES = flags.DEFINE_list("policies", ["bsp", "wsp", "sdpipe", "ad_psgd",
                                           "local_sgd"], "Policies to time.")
_CORE = flags.DEFINE_integer("core", 0, "The core every run is pinned to.")
_MEASURE = flags.DEFINE_string("measure", None, "Internal: policy,pipelines,"
                               "minibatches to time in this process.")
# Here --repeats is runs per point of the table, each in its own process.
flags.FLAGS.set_default("repeats", 3)

STAGES, MICRO = 4, 4
TABLE_PIPELINES = 256


def measure(policy_name: str, pipelines: int, minibatches: int) -> dict:
  """Times one simulation with the `stalepipe` on this process's path."""
  import stalepipe as sp  # pylint: disable=g-import-not-at-top
  costs = sp.sim.StageCosts.uniform(STAGES, 0.01, 0.02, param_bytes=25e6,
                                    activation_bytes=4e6,
                                    samples_per_microbatch=8)
  short = sp.schedules.make("1f1b", num_stages=STAGES, num_microbatches=MICRO,
                            num_minibatches=24)
  schedule = sp.sim.tile(short, minibatches)
  cluster = sp.sim.Cluster.grid(pipelines, STAGES, devices_per_node=8)
  policy = {"bsp": lambda: sp.sim.bsp(), "wsp": lambda: sp.sim.wsp(0, 4),
            "sdpipe": lambda: sp.sim.sdpipe(10, 0.01),
            "ad_psgd": lambda: sp.sim.ad_psgd(),
            "local_sgd": lambda: sp.sim.local_sgd(8)}[policy_name]()
  wall, cpu = time.perf_counter(), time.process_time()
  result = sp.sim.simulate(schedule, cluster, costs, policy,
                           perturbations=[sp.sim.hete("A")], seed=0)
  return {"seconds": time.perf_counter() - wall,
          "cpu_seconds": time.process_time() - cpu,
          "samples_per_second": result.samples_per_second,
          "makespan": result.makespan, "stalepipe": sp.__file__}


def run_point(side: str, source: str, policy: str, pipelines: int,
              minibatches: int) -> dict:
  """`measure` in a fresh process on `--core`, with `source` on the path."""
  env = dict(os.environ, PYTHONPATH=source)
  out = subprocess.run(
      ["taskset", "-c", str(_CORE.value), sys.executable,
       os.path.abspath(__file__),
       f"--measure={policy},{pipelines},{minibatches}"],
      env=env, cwd="/", check=True, capture_output=True, text=True)
  record = json.loads(out.stdout.strip().splitlines()[-1])
  record.update(side=side, policy=policy, pipelines=pipelines,
                workers=pipelines * STAGES, minibatches=minibatches)
  print(f"  {side:6s} {policy:9s} {pipelines * STAGES:5d} workers x "
        f"{minibatches:6d}: {record['seconds']:7.2f} s", flush=True)
  return record


def sweep(points, repeats: int, sides: dict) -> list:
  """Every point `repeats` times, the sides interleaved within each."""
  runs = []
  for r in range(repeats):
    for policy, pipelines, minibatches in points:
      for side, source in sides.items():
        runs.append(dict(run_point(side, source, policy, pipelines,
                                   minibatches), repeat=r))
  return runs


def medians(runs: list) -> list:
  keys = sorted({(r["policy"], r["workers"], r["minibatches"], r["side"])
                 for r in runs})
  out = []
  for policy, workers, minibatches, side in keys:
    mine = [r for r in runs if (r["policy"], r["workers"], r["minibatches"],
                                r["side"]) == (policy, workers, minibatches,
                                               side)]
    out.append({"policy": policy, "workers": workers,
                "minibatches": minibatches, "side": side,
                "median_seconds": statistics.median(r["seconds"]
                                                    for r in mine),
                "median_cpu_seconds": statistics.median(r["cpu_seconds"]
                                                        for r in mine),
                "repeats": len(mine),
                "samples_per_second": mine[0]["samples_per_second"]})
  return out


def table(rows: list, minibatches: int) -> str:
  """Markdown: median wall and CPU seconds before and after, per point."""
  lines = ["| policy | workers | minibatches | before: wall (CPU) s | "
           "after: wall (CPU) s | speed-up (CPU) |", "|---|---|---|---|---|---|"]
  by = {(r["policy"], r["workers"], r["minibatches"], r["side"]): r
        for r in rows}
  for policy, workers, m, side in sorted(by, key=lambda k: (k[1], k[0])):
    if side != "after" or m != minibatches:
      continue
    after = by[(policy, workers, m, "after")]
    before = by.get((policy, workers, m, "before"))
    cell = lambda r: f"{r['median_seconds']:.1f} ({r['median_cpu_seconds']:.1f})"
    ratio = (f"{before['median_cpu_seconds'] / after['median_cpu_seconds']:.1f}x"
             if before else "-")
    lines.append(f"| {policy} | {workers:,} | {m:,} | "
                 f"{cell(before) if before else '-'} | {cell(after)} | "
                 f"{ratio} |")
  return "\n".join(lines)


def main(argv):
  del argv
  if _MEASURE.value:
    policy, pipelines, minibatches = _MEASURE.value.split(",")
    print(json.dumps(measure(policy, int(pipelines), int(minibatches))))
    return
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sides = {"after": here}
  if _BEFORE.value:
    sides = {"before": os.path.abspath(_BEFORE.value), "after": here}
  load = os.getloadavg()
  print(f"## table: {TABLE_PIPELINES * STAGES} workers x "
        f"{_MINIBATCHES.value} minibatches", flush=True)
  runs = sweep([(p, TABLE_PIPELINES, _MINIBATCHES.value)
                for p in _POLICIES.value], harness.REPEATS.value, sides)
  print("## curve", flush=True)
  runs += sweep([(p, int(n), _CURVE_MINIBATCHES.value)
                 for n in _CURVE_PIPELINES.value for p in _POLICIES.value],
                _CURVE_REPEATS.value, sides)
  rows = medians(runs)
  harness.record("sim_speed", {
      "sides": sides, "core": _CORE.value, "load_average_start": load,
      "load_average_end": os.getloadavg(), "medians": rows, "runs": runs})
  print(table(rows, _MINIBATCHES.value))
  print(table(rows, _CURVE_MINIBATCHES.value))
  path = harness.figure_path("sim_speed.png")
  if path:
    _plot(rows, path)
    print(f"wrote {path}")


def _plot(rows: list, path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4))
  m = _CURVE_MINIBATCHES.value
  for policy in _POLICIES.value:
    for side, style in (("after", "-o"), ("before", "--x")):
      pts = sorted((r["workers"], r["median_seconds"]) for r in rows
                   if r["policy"] == policy and r["side"] == side
                   and r["minibatches"] == m)
      if pts:
        line = ax.plot(*zip(*pts), style, label=f"{policy} ({side})")[0]
        style = line.get_color()
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("workers (pipelines x 4 stages)")
  ax.set_ylabel(f"simulate seconds, {m:,} minibatches, one core")
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  harness.run(main)
