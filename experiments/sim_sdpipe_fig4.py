"""Seed 002 Figure 4 in the simulator: sync schemes under stragglers.

All-Reduce+Pipe (`bsp`), AD-PSGD+Pipe (`ad_psgd`), HetPipe (`wsp` through a
central parameter server) and SDPipe (`sdpipe(P=10, T=1/N of an iteration)`),
every one on PipeDream-Flush 1F1B pipelines (seed 002 §5.1), for ResNet-50
and BERT-base on M x N workers (M stages, N pipelines), homogeneous and under
hete-A / hete-B (each worker sleeps 0.1/0.3 s on ResNet, 0.2/0.6 s on BERT
with probability 10% per iteration, §5.1), plus 4 x 16 = 64 workers (§5.4).

Cluster (§5.1): A100 GPUs, 8 per node, 10 Gb Ethernet across nodes;
pipelines are placed pipeline-major, so a pipeline's stages share a node and
a stage's replicas span nodes. Assumptions (the paper does not give them):
per-pipeline minibatch 256 images (ResNet-50) / 64 sequences of 128 tokens
(BERT-base), 8 micro-batches, an A100 at 15 TFLOP/s achieved (FP32),
training FLOPs = 6 x MACs (ResNet-50: 4.1 GMAC/image) or 6 x parameters x
tokens (BERT), equal stages (§5.1 "default homogeneous model partitioning"),
float32 parameters (ResNet-50 25.6M, BERT-base 110M) split evenly, NVLink-class
links in a node (100 GB/s), HetPipe's parameter server on one node behind one
10 Gb NIC with D = 0 and waves of one minibatch. Throughput is the steady
rate over 200 minibatches per pipeline, mean of 3 seeds.

Usage:
  .venv/bin/python experiments/sim_sdpipe_fig4.py [--out_dir=DIR] \
      [--write_figures]
"""

import numpy as np

import harness
import stalepipe as sp

MODELS = {  # samples per minibatch, training FLOPs per minibatch, bytes
    "resnet50": dict(samples=256, flops=6 * 4.1e9 * 256, params=25.6e6 * 4,
                     activation=256 * 512 * 28 * 28 * 4),
    "bert": dict(samples=64, flops=6 * 110e6 * 128 * 64, params=110e6 * 4,
                 activation=64 * 128 * 768 * 4),
}
RATE = 15e12  # achieved FLOP/s of one A100 (FP32: 19.5 peak)
MICRO = 8
MINIBATCHES = 200
SEEDS = (0, 1, 2)
CONFIGS = ((2, 8), (4, 4), (8, 2), (4, 16))  # (stages M, pipelines N)
SETTINGS = ("homo", "A", "B")
INTRA = sp.sim.Link(100e9, 5e-6)
ETHERNET = sp.sim.Link(10e9 / 8, 50e-6)


def setup(model, stages, pipelines):
  m = MODELS[model]
  per_stage = m["flops"] / RATE / stages / MICRO  # one micro-batch
  costs = sp.sim.StageCosts.uniform(
      stages, per_stage / 3, 2 * per_stage / 3,
      activation_bytes=m["activation"] / MICRO,
      param_bytes=m["params"] / stages,
      samples_per_microbatch=m["samples"] // MICRO)
  cluster = sp.sim.Cluster.grid(pipelines, stages, devices_per_node=8,
                                intra=INTRA, inter=ETHERNET, ps=ETHERNET)
  short = sp.schedules.make("1f1b", num_stages=stages, num_microbatches=MICRO,
                            num_minibatches=3 * stages + 8)
  return cluster, costs, sp.sim.tile(short, MINIBATCHES)


def run(model, stages, pipelines, setting):
  cluster, costs, schedule = setup(model, stages, pipelines)
  alone = sp.sim.simulate(schedule, cluster, costs)
  iteration = alone.makespan / MINIBATCHES
  policies = {
      "All-Reduce+Pipe": sp.sim.bsp(),
      "AD-PSGD+Pipe": sp.sim.ad_psgd(),
      "HetPipe": sp.sim.wsp(0, 1),
      "SDPipe": sp.sim.sdpipe(10, iteration / pipelines),
  }
  hete = [] if setting == "homo" else [
      sp.sim.hete(setting, "resnet" if model == "resnet50" else "bert")]
  out = {}
  for name, policy in policies.items():
    rates, stale = [], []
    for seed in SEEDS:
      r = sp.sim.simulate(schedule, cluster, costs, policy,
                          perturbations=hete, seed=seed)
      rates.append(r.steady_samples_per_second(skip=20))
      stale.append(r.staleness[:, 20:].mean() / pipelines)
    out[name] = (float(np.mean(rates)), float(np.mean(stale)))
  return out


def main(argv):
  del argv
  results = {}
  for model in MODELS:
    print(f"\n### {model}: samples/s (mean observed staleness per replica, "
          "updates)\n")
    print("| M x N | setting | All-Reduce+Pipe | AD-PSGD+Pipe | HetPipe | "
          "SDPipe | SDPipe / All-Reduce | SDPipe / AD-PSGD |")
    print("|---|---|---|---|---|---|---|---|")
    for stages, pipelines in CONFIGS:
      for setting in SETTINGS:
        out = run(model, stages, pipelines, setting)
        results[(model, stages, pipelines, setting)] = out
        cells = " | ".join(f"{v:.0f} ({s:.1f})" for v, s in out.values())
        sd = out["SDPipe"][0]
        print(f"| {stages}x{pipelines} | {setting} | {cells} | "
              f"{sd / out['All-Reduce+Pipe'][0]:.2f}x | "
              f"{sd / out['AD-PSGD+Pipe'][0]:.2f}x |")
  for model in MODELS:
    for stages, pipelines in CONFIGS:
      homo = results[(model, stages, pipelines, "homo")]["SDPipe"][0]
      b = results[(model, stages, pipelines, "B")]["SDPipe"][0]
      print(f"{model} {stages}x{pipelines}: SDPipe slowdown homo -> hete-B "
            f"{homo / b:.2f}x")
  harness.record("sim_sdpipe_fig4", {
      f"{model} {stages}x{pipelines} {setting}": {
          name: {"samples_per_second": rate, "staleness": stale}
          for name, (rate, stale) in out.items()}
      for (model, stages, pipelines, setting), out in results.items()})
  path = harness.figure_path("sim_sdpipe_fig4.png")
  if path:
    _plot(results, path)
    print(f"wrote {path}")


def _plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  names = ("All-Reduce+Pipe", "AD-PSGD+Pipe", "HetPipe", "SDPipe")
  fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
  for row, model in enumerate(MODELS):
    for col, setting in enumerate(SETTINGS):
      ax = axes[row, col]
      x = np.arange(len(CONFIGS))
      for k, name in enumerate(names):
        values = [results[(model, m, n, setting)][name][0]
                  for m, n in CONFIGS]
        ax.bar(x + (k - 1.5) * 0.2, values, 0.2, label=name)
      ax.set_xticks(x, [f"{m}x{n}" for m, n in CONFIGS])
      title = "homogeneous" if setting == "homo" else f"hete-{setting}"
      ax.set_title(f"{model}, {title}")
      ax.set_ylabel("samples/s")
      if row == 0 and col == 0:
        ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  harness.run(main)
