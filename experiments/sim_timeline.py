"""A simulated timeline: 3 pipelines x 3 stages of 1F1B under SDPipe and hete-B.

Draws the run with the schedule renderer (`render.gantt_png`) and writes a
Chrome/Perfetto trace next to it.

Usage:
  .venv/bin/python experiments/sim_timeline.py \
      [--png docs/figures/sim_timeline.png] [--trace /tmp/sim_timeline.json]
"""

import argparse

import stalepipe as sp
from stalepipe.schedules import render


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--png", default="docs/figures/sim_timeline.png")
  parser.add_argument("--trace", default="/tmp/sim_timeline.json")
  args = parser.parse_args()
  s = sp.schedules.make("1f1b", num_stages=3, num_microbatches=2,
                        num_minibatches=4)
  cluster = sp.sim.Cluster.grid(3, 3, devices_per_node=3,
                                inter=sp.sim.Link(1e9, 1e-3))
  costs = sp.sim.StageCosts.uniform(3, 0.05, 0.1, activation_bytes=5e6,
                                    param_bytes=4e7)
  r = sp.sim.simulate(s, cluster, costs, sp.sim.sdpipe(2, 0.02),
                      perturbations=[sp.sim.Stragglers(0.2, 0.3)], seed=3)
  events = r.timeline()
  render.gantt_png(events, args.png, time_unit="s",
                   title="1F1B, SDPipe(P=2, T=20 ms), 20% x 0.3 s sleeps")
  render.chrome_trace(events, args.trace, time_unit="s")
  groups = [[[g.tolist() for g in it] for it in st]
            for st in r.extras["sdpipe_groups"]]
  print(f"makespan {r.makespan:.3f} s; groups per stage and iteration: "
        f"{groups}; validations skipped: {r.extras['sdpipe_skipped']}")
  print(f"wrote {args.png} and {args.trace}")


if __name__ == "__main__":
  main()
