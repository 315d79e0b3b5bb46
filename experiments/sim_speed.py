"""Simulator speed: 64 workers x 1,000 iterations; cost vs iterations x workers.

Runs on one CPU core (the process pins itself to core 0). Times `simulate`
alone; building the schedule (by tiling a short one, `sp.sim.tile`) is timed
apart. Each point is the best of `--repeats` runs, since the machine is shared.

Usage:
  .venv/bin/python experiments/sim_speed.py [--repeats 3] \
      [--png docs/figures/sim_speed.png]
"""

import argparse
import os
import time

import numpy as np

import stalepipe as sp

STAGES, MICRO = 4, 4
COSTS = sp.sim.StageCosts.uniform(STAGES, 0.01, 0.02, param_bytes=25e6,
                                  activation_bytes=4e6,
                                  samples_per_microbatch=8)


def schedule(name, iterations, **kw):
  short = sp.schedules.make(name, num_stages=STAGES, num_microbatches=MICRO,
                            num_minibatches=24, **kw)
  return sp.sim.tile(short, iterations)


def best_time(fn, repeats):
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t)
  return min(times), out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--png", default="docs/figures/sim_speed.png")
  args = parser.parse_args()
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

  print("## 16 pipelines x 4 stages = 64 workers, 1,000 iterations, M = 4")
  cluster = sp.sim.Cluster.grid(16, STAGES, devices_per_node=8)
  hete = [sp.sim.hete("A")]
  t_build, s_1f1b = best_time(lambda: schedule("1f1b", 1000), 1)
  t_build_h, s_het = best_time(
      lambda: sp.sim.tile(sp.schedules.make(
          "hetpipe", num_stages=STAGES, num_microbatches=1, num_minibatches=24,
          concurrent_minibatches=4), 1000), 1)
  print(f"schedule build (tile): 1f1b {t_build:.2f} s, hetpipe "
        f"{t_build_h:.2f} s; tasks per pipeline: {len(s_1f1b.tasks)}")
  print("| schedule | policy | stragglers | simulate (s) | samples/s |")
  print("|---|---|---|---|---|")
  runs = [("1f1b", s_1f1b, sp.sim.bsp()), ("1f1b", s_1f1b, sp.sim.ad_psgd()),
          ("1f1b", s_1f1b, sp.sim.sdpipe(10, 0.01)),
          ("1f1b", s_1f1b, sp.sim.local_sgd(8)),
          ("hetpipe", s_het, sp.sim.wsp(0, 4))]
  for name, s, policy in runs:
    t, r = best_time(lambda: sp.sim.simulate(s, cluster, COSTS, policy,
                                             perturbations=hete),
                     args.repeats)
    print(f"| {name} | {policy.name} | hete-A | {t:.2f} | "
          f"{r.samples_per_second:.0f} |")

  print("\n## cost vs iterations x workers (1f1b + bsp, hete-A)")
  print("| pipelines | workers | iterations | simulate (s) |")
  print("|---|---|---|---|")
  points = []
  for pipelines in (1, 4, 16, 64):
    cluster = sp.sim.Cluster.grid(pipelines, STAGES, devices_per_node=8)
    for iterations in (125, 250, 500, 1000, 2000):
      s = schedule("1f1b", iterations)
      t, _ = best_time(lambda: sp.sim.simulate(s, cluster, COSTS, sp.sim.bsp(),
                                               perturbations=hete),
                       args.repeats)
      workers = pipelines * STAGES
      points.append((pipelines, workers, iterations, t))
      print(f"| {pipelines} | {workers} | {iterations} | {t:.3f} |")
  points = np.array(points)
  its, workers, y = points[:, 2], points[:, 1], points[:, 3]
  # t = iterations x (alpha + beta x workers): one NumPy op per task over all
  # pipelines (alpha) plus the per-element work (beta).
  design = np.stack([its, its * workers], axis=1)
  (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
  fit = design @ np.array([alpha, beta])
  r2 = 1 - ((fit - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
  print(f"\nfit: t = iterations x ({alpha * 1e3:.3f} ms + {beta * 1e6:.3f} us "
        f"x workers), R^2 = {r2:.3f}")
  print(f"bound at 64 workers x 1,000 iterations: "
        f"{1000 * (alpha + beta * 64):.2f} s")

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
  for p in np.unique(points[:, 0]):
    sel = points[:, 0] == p
    w = int(p * STAGES)
    line = ax0.plot(its[sel] * workers[sel], y[sel], "o",
                    label=f"{w} workers")[0]
    grid = np.array([0.0, its[sel].max()])
    ax0.plot(grid * w, grid * (alpha + beta * w), "-", lw=0.8,
             color=line.get_color())
    ax1.plot(its[sel], y[sel], "o", color=line.get_color(),
             label=f"{w} workers")
    ax1.plot(grid, grid * (alpha + beta * w), "-", lw=0.8,
             color=line.get_color())
  ax0.set_xscale("log")
  ax0.set_yscale("log")
  ax0.set_xlabel("iterations x workers")
  ax0.set_ylabel("simulate time (s, one core)")
  ax0.set_title(f"fit t = it x ({alpha * 1e3:.2f} ms + {beta * 1e6:.2f} us x "
                f"workers), R^2={r2:.2f}", fontsize=9)
  ax0.legend(fontsize=7)
  ax1.set_xlabel("iterations")
  ax1.set_ylabel("simulate time (s, one core)")
  ax1.set_title("linear in iterations at every size (lines: the fit)",
                fontsize=9)
  ax1.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(args.png, dpi=120)
  print(f"wrote {args.png}")


if __name__ == "__main__":
  main()
