"""SDPipe's groups per iteration against by arrival (seed 002 Algorithm 2).

The clusters, costs and stragglers of `sim_sdpipe_fig4.py` (ResNet-50 and
BERT-base on M x N A100 workers over 10 Gb Ethernet, PipeDream-Flush 1F1B
pipelines, 200 minibatches per pipeline, hete-B: each worker sleeps 0.3 s
(ResNet) / 0.6 s (BERT) with probability 10% per iteration), SDPipe with
P = 10 and T = 1/N of an iteration, grouping by iteration (the default: the
replicas that finished the same minibatch) against by arrival (whoever
signals within T, whatever iteration each is at). Per configuration, means
over 3 seeds of: the steady throughput (from minibatch 20 on), the mean
group size, the fraction of groups holding workers at two or more
iterations, the seconds a worker spends averaging per iteration, the
observed staleness per replica (updates; from minibatch 20 on) and the
validations deadlock prevention skipped.

Usage:
  .venv/bin/python experiments/sim_sdpipe_arrival.py [--out_dir=DIR]
"""

import numpy as np

import harness
import sim_sdpipe_fig4 as fig4
import stalepipe as sp

CONFIGS = ((2, 8), (4, 4), (4, 16))  # (stages M, pipelines N)
SKIP = 20


def measure(model: str, stages: int, pipelines: int, grouping: str) -> dict:
  """The run's figures, means over `fig4.SEEDS`."""
  cluster, costs, schedule = fig4.setup(model, stages, pipelines)
  iteration = sp.sim.simulate(schedule, cluster,
                              costs).makespan / fig4.MINIBATCHES
  policy = sp.sim.sdpipe(10, iteration / pipelines, grouping=grouping)
  hete = [sp.sim.hete("B", "resnet" if model == "resnet50" else "bert")]
  rows = []
  for seed in fig4.SEEDS:
    r = sp.sim.simulate(schedule, cluster, costs, policy, perturbations=hete,
                        seed=seed)
    if grouping == "arrival":
      groups = [g for stage in r.extras["sdpipe_arrivals"] for g in stage]
      sizes = [len(g.members) for g in groups]
      mixed = [len(set(g.iterations.tolist())) > 1 for g in groups]
    else:
      sizes = [len(g) for stage in r.extras["sdpipe_groups"]
               for row in stage for g in row]
      mixed = [False]
    averaging = sum((e.end - e.start).sum() for _, e in r.comm) / (
        stages * pipelines * fig4.MINIBATCHES)
    rows.append((r.steady_samples_per_second(skip=SKIP), np.mean(sizes),
                 np.mean(mixed), averaging,
                 r.staleness[:, SKIP:].mean() / pipelines,
                 len(r.extras["sdpipe_skipped"])))
  keys = ("samples_per_second", "group_size", "mixed_fraction",
          "averaging_seconds", "staleness", "skipped")
  return dict(zip(keys, np.mean(rows, axis=0).tolist()))


def main(argv):
  del argv
  results = {}
  print("| model | M x N | grouping | samples/s | mean group size | "
        "mixed-iteration groups | averaging s / iteration | observed "
        "staleness | validations skipped |")
  print("|---|---|---|---|---|---|---|---|---|")
  for model in fig4.MODELS:
    for stages, pipelines in CONFIGS:
      for grouping in ("iteration", "arrival"):
        out = measure(model, stages, pipelines, grouping)
        results[f"{model} {stages}x{pipelines} {grouping}"] = out
        print(f"| {model} | {stages}x{pipelines} | {grouping} | "
              f"{out['samples_per_second']:.0f} | {out['group_size']:.2f} | "
              f"{out['mixed_fraction']:.0%} | "
              f"{out['averaging_seconds']:.3f} | {out['staleness']:.2f} | "
              f"{out['skipped']:.0f} |")
  harness.record("sim_sdpipe_arrival", results)


if __name__ == "__main__":
  harness.run(main)
