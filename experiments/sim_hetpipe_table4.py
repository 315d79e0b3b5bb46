"""Seed 001 Table 4 in the simulator: throughput as whimpy GPUs are added.

For VGG-19 and ResNet-152 at batch 32 (seed 001 §8.1), on the GPU sets 4[V],
4[VR], 4[VRQ], 4[VRQG] (four nodes of four GPUs, one node per type, Table 1):

- Single GPU [V]: one TITAN V, no sync.
- Horovod: one full model per GPU, ring all-reduce of all parameters every
  iteration (`sp.sync.bsp`), every GPU at batch 32, so the slowest GPU sets
  the pace; a GPU whose memory cannot hold the model makes the column "X".
- HetPipe (ED-local): four virtual workers, each with one GPU of every node
  (one VW of 4 V for "4 GPUs"), partitioned by `sp.plan.partition` at the
  paper's N_m and simulated from that plan (`sp.sim.from_plan`), running the
  `hetpipe` schedule under WSP with D = 0 (`sp.sync.wsp`), each stage's
  parameter-server shard on its own node.

Cost model (shared with `stalepipe.plan.analytic`): per-block FLOPs from the
published architectures, backward = 2 x forward, a device's rate = peak FP32
of Table 1 x an efficiency calibrated per model so that one TITAN V gives
Table 4's "Single GPU [V]" throughput. Two network settings:

- nominal: PCIe 3 x16 (15.75 GB/s, 10 us) in a node, 56 Gb/s InfiniBand
  (7 GB/s, 20 us) across nodes, parameter servers on PCIe (ED-local);
- effective: every link (and the PS) at the bandwidth that makes the
  simulated Horovod 4[V] match the paper's 164 images/s (VGG-19) and
  233 images/s (ResNet-152): the paper's TensorFlow moves tensors far below
  nominal link speed.

Usage:
  .venv/bin/python experiments/sim_hetpipe_table4.py [--out_dir=DIR] \
      [--write_figures]
"""

import numpy as np

import harness
import stalepipe as sp
from stalepipe.plan import analytic
from stalepipe.plan import devices as dev

BATCH = 32
SINGLE_V = {"vgg19": 159.0, "resnet152": 112.0}  # Table 4, images/s
RESERVED = dev.GIB // 2  # CUDA context, workspace (as plan_hetpipe.py)
SETS = ("V", "VR", "VRQ", "VRQG")
# Seed 001 Table 4: Horovod images/s; HetPipe images/s and total N_m.
PAPER_HOROVOD = {"vgg19": (164, 205, 265, 339),
                 "resnet152": (233, 353, 415, None)}
PAPER_HETPIPE = {"vgg19": ((300, 5), (530, 16), (572, 20), (606, 20)),
                 "resnet152": ((256, 5), (516, 20), (538, 24), (580, 28))}
MINIBATCHES = 400  # per virtual worker / GPU, tiled steady state


def usable(spec):
  return spec._replace(memory_bytes=spec.memory_bytes - RESERVED)


def profiles_for(model):
  blocks = analytic.MODELS[model]()
  efficiency = (SINGLE_V[model] * analytic.training_flops(blocks)
                / (dev.TITAN_V.tflops * 1e12))
  return {t.name: analytic.profile(blocks, usable(t), BATCH, efficiency)
          for t in dev.TABLE1.values()}


def network(bandwidth=None):
  """Seed 001 §8.1's links, or every link at `bandwidth` (20 us)."""
  if bandwidth is None:
    return dev.HETPIPE_NETWORK
  link = sp.plan.Link(bandwidth, 20e-6)
  return dev.Network.of(link, link)


def single(profiles):
  p = profiles["V"]
  return BATCH / (sum(p.forward_s) + sum(p.backward_s))


def horovod(profiles, types, bandwidth=None):
  """Images/s of data parallelism over 4 GPUs of each type, or None (OOM)."""
  ref = profiles["V"]
  blocks = ref.num_blocks
  for t in types:
    need = sp.plan.stage_memory(profiles[t], 0, blocks, 0, 1)
    if need > usable(dev.TABLE1[t]).memory_bytes:
      return None
  net = network(bandwidth)
  rows = tuple((sp.sim.Device(t, dev.TABLE1[t].tflops / dev.TITAN_V.tflops,
                              node=i),)
               for i, t in enumerate(types) for _ in range(4))
  cluster = sp.sim.Cluster(rows, intra=net.intra, inter=net.inter,
                           ps=net.inter)
  costs = sp.sim.StageCosts((sum(ref.forward_s),), (sum(ref.backward_s),),
                            param_bytes=(sum(ref.param_bytes),),
                            samples_per_microbatch=BATCH)
  s = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1,
                        num_minibatches=MINIBATCHES // 8)
  r = sp.sim.simulate(s, cluster, costs, sp.sync.bsp(cluster.num_pipelines))
  return r.steady_samples_per_second(skip=5)


def hetpipe(profiles, types, total_nm, bandwidth=None):
  """(images/s, N_m used, plan) of HetPipe ED-local with WSP D=0."""
  net = network(bandwidth)
  workers = 1 if types == "V" else 4
  concurrent = total_nm // workers
  if types == "V":
    vw = [dev.Device(usable(dev.TITAN_V), 0, k) for k in range(4)]
  else:
    vw = [dev.Device(usable(dev.TABLE1[t]), i, 0) for i, t in enumerate(types)]
  while True:
    try:
      plan = sp.plan.partition(profiles, vw, concurrent=concurrent,
                               network=net)
      break
    except sp.plan.InfeasiblePlanError:
      concurrent -= 1
  cluster, costs = sp.sim.from_plan(plan, num_pipelines=workers,
                                    network=net, ps="intra", ps_shared=False,
                                    samples_per_microbatch=BATCH)
  S = cluster.num_stages
  short = sp.schedules.make("hetpipe", num_stages=S, num_microbatches=1,
                            num_minibatches=8 * concurrent + 8,
                            concurrent_minibatches=concurrent)
  s = sp.sim.tile(short, MINIBATCHES)
  policy = sp.sim.isolated() if workers == 1 else sp.sync.wsp(
      workers, clock_distance=0, concurrent_minibatches=concurrent)
  r = sp.sim.simulate(s, cluster, costs, policy)
  order = "".join(d.spec.name for d in plan.devices)
  return (r.steady_samples_per_second(skip=4 * concurrent),
          concurrent * workers, f"{order}{list(plan.boundaries)}")


def effective_bandwidth(profiles, model):
  """Bandwidth at which simulated Horovod 4[V] gives the paper's images/s."""
  lo, hi = 1e7, 1e11
  for _ in range(60):
    mid = np.sqrt(lo * hi)
    if horovod(profiles, "V", mid) > PAPER_HOROVOD[model][0]:
      hi = mid
    else:
      lo = mid
  return np.sqrt(lo * hi)


def main(argv):
  del argv
  results, record = {}, {}
  for model in ("vgg19", "resnet152"):
    profiles = profiles_for(model)
    bw = effective_bandwidth(profiles, model)
    record[model] = {"single_v": single(profiles),
                     "effective_bandwidth": float(bw)}
    print(f"\n### {model}: single V {single(profiles):.0f} images/s "
          f"(paper {SINGLE_V[model]:.0f}, calibrated); effective bandwidth "
          f"{bw / 1e9:.2f} GB/s\n")
    print("| network | method | 4 [V] | 8 [VR] | 12 [VRQ] | 16 [VRQG] |")
    print("|---|---|---|---|---|---|")
    paper_h = " | ".join("X" if v is None else str(v)
                         for v in PAPER_HOROVOD[model])
    paper_p = " | ".join(f"{v} ({n})" for v, n in PAPER_HETPIPE[model])
    print(f"| paper | Horovod | {paper_h} |")
    print(f"| paper | HetPipe | {paper_p} |")
    for label, bandwidth in (("nominal", None), ("effective", bw)):
      hv = [horovod(profiles, t, bandwidth) for t in SETS]
      hp = [hetpipe(profiles, t, n, bandwidth)
            for t, (_, n) in zip(SETS, PAPER_HETPIPE[model])]
      results[(model, label)] = (hv, [x[0] for x in hp])
      record[model][label] = {
          "sets": SETS, "horovod": hv, "hetpipe": [x[0] for x in hp],
          "hetpipe_total_nm": [x[1] for x in hp],
          "hetpipe_plan": [x[2] for x in hp]}
      print(f"| {label} | Horovod | " + " | ".join(
          "X" if v is None else f"{v:.0f}" for v in hv) + " |")
      print(f"| {label} | HetPipe | " + " | ".join(
          f"{v:.0f} ({n})" for v, n, _ in hp) + " |")
      print(f"| {label} | HetPipe plan | " + " | ".join(
          p for _, _, p in hp) + " |")
  harness.record("sim_hetpipe_table4", record)
  path = harness.figure_path("sim_hetpipe_table4.png")
  if path:
    _plot(results, path)
    print(f"wrote {path}")


def _plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  x = np.arange(len(SETS))
  for ax, model in zip(axes, ("vgg19", "resnet152")):
    paper_h = [np.nan if v is None else v for v in PAPER_HOROVOD[model]]
    paper_p = [v for v, _ in PAPER_HETPIPE[model]]
    ax.plot(x, paper_p, "k-o", label="paper HetPipe")
    ax.plot(x, paper_h, "k--s", label="paper Horovod")
    for label, colour in (("nominal", "tab:blue"), ("effective", "tab:red")):
      hv, hp = results[(model, label)]
      hv = [np.nan if v is None else v for v in hv]
      ax.plot(x, hp, "-o", color=colour, label=f"sim HetPipe ({label} links)")
      ax.plot(x, hv, "--s", color=colour, label=f"sim Horovod ({label} links)")
    ax.set_xticks(x, [f"{4 * len(t)} [{t}]" for t in SETS])
    ax.set_yscale("log")
    ax.set_ylabel("images/s")
    ax.set_title(f"{model}: adding whimpy GPUs (seed 001 Table 4)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  harness.run(main)
