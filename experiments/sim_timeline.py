"""A simulated timeline: 3 pipelines x 3 stages of 1F1B under SDPipe and hete-B.

Draws the run with the schedule renderer (`render.gantt_png`) and writes a
Chrome/Perfetto trace (`sim_timeline.trace.json`) into `--out_dir`.

Usage:
  .venv/bin/python experiments/sim_timeline.py [--out_dir=DIR] \
      [--write_figures]
"""

import os

import harness
import stalepipe as sp
from stalepipe.schedules import render


def main(argv):
  del argv
  s = sp.schedules.make("1f1b", num_stages=3, num_microbatches=2,
                        num_minibatches=4)
  cluster = sp.sim.Cluster.grid(3, 3, devices_per_node=3,
                                inter=sp.sim.Link(1e9, 1e-3))
  costs = sp.sim.StageCosts.uniform(3, 0.05, 0.1, activation_bytes=5e6,
                                    param_bytes=4e7)
  r = sp.sim.simulate(s, cluster, costs, sp.sim.sdpipe(2, 0.02),
                      perturbations=[sp.sim.Stragglers(0.2, 0.3)], seed=3)
  events = r.timeline()
  groups = [[[g.tolist() for g in it] for it in st]
            for st in r.extras["sdpipe_groups"]]
  print(f"makespan {r.makespan:.3f} s; groups per stage and iteration: "
        f"{groups}; validations skipped: {r.extras['sdpipe_skipped']}")
  harness.record("sim_timeline", {
      "makespan": r.makespan, "sdpipe_groups": groups,
      "sdpipe_skipped": r.extras["sdpipe_skipped"]})
  path = harness.figure_path("sim_timeline.png")
  if path:
    render.gantt_png(events, path, time_unit="s",
                     title="1F1B, SDPipe(P=2, T=20 ms), 20% x 0.3 s sleeps")
    print(f"wrote {path}")
  if harness.OUT_DIR.value:
    trace = os.path.join(harness.OUT_DIR.value, "sim_timeline.trace.json")
    render.chrome_trace(events, trace, time_unit="s")
    print(f"wrote {trace}")


if __name__ == "__main__":
  harness.run(main)
