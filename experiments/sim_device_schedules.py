"""Device-level schedules on the simulator at unit costs, against closed forms.

P = 4 devices of v = 2 chunks (S = 8 stages), zero-cost links; F = B = 1
(interleaved 1F1B, PipeDream-V) or F = BI = BW = 1 (ZB-V, DualPipeV, whose
overlapped F&B takes max(F, B) = 2). Prints each schedule's simulated
makespan of one minibatch (M = 8) next to its closed form (`stalepipe.theory`,
docs/schedules.md) and each device's idle seconds next to its idle ticks in
the schedule's table; PipeDream-V (one micro-batch a minibatch, no flush)
its steady seconds a minibatch over 64 minibatches, 2v.

Usage:
  .venv/bin/python experiments/sim_device_schedules.py [--out_dir=DIR]
"""

import harness
import stalepipe as sp
from stalepipe import theory

P, V, M = 4, 2, 8
S = P * V
UNIT = dict(forward=1.0, backward=1.0)
SPLIT = dict(forward=1.0, backward=2.0, weight_gradient=1.0)
FLUSHED = {  # name: (options, costs, closed-form makespan)
    "interleaved-1f1b": ({"num_devices": P}, UNIT,
                         theory.interleaved_1f1b_makespan(P, V, M)),
    "zb-v": ({}, SPLIT, theory.zero_bubble_v_makespan(P, M)),
    "dualpipev": ({}, SPLIT, 4 * M + 3 * P),
}


def simulate(name, costs, **kw):
  s = sp.schedules.make(name, num_stages=S, **kw)
  free = sp.sim.Link(float("inf"), 0.0)
  return sp.sim.simulate(s, sp.sim.Cluster.grid(1, P, intra=free, inter=free),
                         sp.sim.StageCosts.uniform(S, **costs))


def main(argv):
  del argv
  rows = {}
  print(f"{'schedule':18s} {'makespan':>8s} {'closed':>6s}  device idle "
        "(the schedule's idle ticks)")
  for name, (kw, costs, ticks) in FLUSHED.items():
    r = simulate(name, costs, num_microbatches=M, **kw)
    got = r.device_idle[0].tolist()
    idle = (r.schedule.num_ticks - r.schedule.device_busy.sum(0)).tolist()
    rows[name] = {"makespan": r.makespan, "closed_form": ticks,
                  "device_idle": got, "schedule_idle_ticks": idle}
    print(f"{name:18s} {r.makespan:8.1f} {ticks:6d}  {got} ({idle})")
  print("dualpipev's README bubble (P - 1)(F&B + B - 3W) = "
        f"{theory.dualpipev_bubble(P, t_f_and_b=2, t_b=2, t_w=1)}: the last "
        "devices' idle")
  B, skip = 64, 16
  r = simulate("pipedream-v", UNIT, num_microbatches=1, num_minibatches=B)
  period = 1 / r.steady_samples_per_second(skip)
  rows["pipedream-v"] = {"steady_seconds_a_minibatch": period,
                         "closed_form": 2 * V}
  print(f"{'pipedream-v':18s} steady {period:.2f} s a minibatch "
        f"(closed form 2v = {2 * V})")
  harness.record("sim_device_schedules", rows)


if __name__ == "__main__":
  harness.run(main)
