"""Stash memory per device of asynchronous PipeDream, per placement.

  python experiments/async_device_stash.py [--devices=4,8]

For P devices, prints one markdown row per way of running PipeDream's rules
(weight stashing, each stage's update after its own backward, no flush):
stage-level `pipedream` with one stage a device (S = P), the same schedule
with S = 2P stages folded two a device on the consecutive and on the V
placement (every local stage runs every tick), and the device-level
`pipedream-interleaved` (loop placement) and `pipedream-v` (S = 2P, one
chunk task a device a tick). Columns: the weight versions each device keeps
(`device_stash_depth`: `stash_depth` summed over its stages), their maximum,
the minibatches in flight on stage 0, the steady state's bubble (idle
stage slots, or device ticks for a device-level schedule, between the
entries of minibatches B/3 and 2B/3) and the per-stage staleness d_s
(minibatch p reads max(0, p - d_s) there; the most over the last minibatches
where it varies), all counted on the tables.

Two more rows measure what `pipedream-v`'s admission buys (a minibatch every
4 ticks, its tasks at fixed offsets, `schedules/stashed.py`): the same
per-chunk rules on the V with PipeDream's own admission instead, a minibatch
entering whenever fewer than K are in flight, each device running its ready
backward first (oldest minibatch first), else its oldest ready forward, with
K = P and K = P + 1 (`in_flight_admission`, built here only).
"""

from absl import app
from absl import flags

import stalepipe as sp
from stalepipe.schedules.core import Schedule, Task

_DEVICES = flags.DEFINE_list("devices", ["4", "8"], "Values of P.")
B = 48  # minibatches in each table


def _steady_bubble(schedule) -> float:
  entry = {t.minibatch: t.tick for t in schedule.tasks
           if (t.stage, t.kind) == (0, "F")}
  busy = schedule.busy if schedule.placed is None else schedule.device_busy
  return 1.0 - float(busy[entry[B // 3]:entry[2 * B // 3]].mean())


def _row(label, placement, schedule, P):
  if schedule.placed is None:
    placed = sp.pipeline.placement.make(placement, schedule.num_stages, P)
    stash = [sum(schedule.stash_depth[s] for s in placed.stages[d])
             for d in range(P)]
  else:
    stash = list(schedule.device_stash_depth)
  missed = [max(p - schedule.version(p, s, "F") for p in range(B - 8, B))
            for s in range(schedule.num_stages)]
  return (f"| {label} | {placement} | {P} | {schedule.num_stages} | "
          f"{' '.join(map(str, stash))} | {max(stash)} | "
          f"{schedule.max_in_flight[0]} | {_steady_bubble(schedule):.3f} | "
          f"{' '.join(map(str, missed))} | {max(missed)} |")


def in_flight_admission(num_stages: int, K: int) -> Schedule:
  """PipeDream's per-chunk rules on the V, a minibatch entering whenever
  fewer than K are in flight; each device runs its ready backward first."""
  S, P = num_stages, num_stages // 2
  placed = sp.pipeline.placement.make("v", S, P)
  next_f, next_b, f_end, b_end = [0] * S, [0] * S, {}, {}
  updates = [[] for _ in range(S)]  # per stage, the end tick of each update
  tasks, versions, tick = [], {}, 0
  while len(tasks) < 2 * S * B:
    done = sum(e <= tick for e in updates[0])
    for d in range(P):
      ready = []
      for s in map(int, placed.stages[d]):
        p = next_b[s]
        if (p < next_f[s] and f_end[(p, s)] <= tick
            and (s == S - 1 or b_end.get((p, s + 1), tick + 1) <= tick)):
          ready.append((0, p, s, "B"))
        p = next_f[s]
        if p < B and (f_end.get((p, s - 1), tick + 1) <= tick if s
                      else p - done < K):
          ready.append((1, p, s, "F"))
      if ready:
        _, p, s, kind = min(ready)
        tasks.append(Task(tick, s, kind, p, 0))
        if kind == "F":
          versions[(p, s, "F", 0)] = sum(e <= tick for e in updates[s])
          f_end[(p, s)], next_f[s] = tick + 1, next_f[s] + 1
        else:
          versions[(p, s, "B", 0)] = versions[(p, s, "F", 0)]
          b_end[(p, s)], next_b[s] = tick + 1, next_b[s] + 1
          updates[s].append(tick + 1)
    tick += 1
  tasks.sort(key=lambda t: (t.tick, t.stage))
  return Schedule("in-flight", S, 1, B, tuple(tasks), versions,
                  placement="v", num_devices=P).validate()


def rows(P: int) -> list[str]:
  """The table's rows for P devices."""
  make = sp.schedules.make
  one = make("pipedream", num_stages=P, num_microbatches=1, num_minibatches=B)
  two = make("pipedream", num_stages=2 * P, num_microbatches=1,
             num_minibatches=B)
  return [
      _row("pipedream, a stage a device", "consecutive", one, P),
      _row("pipedream, folded 2 a device", "consecutive", two, P),
      _row("pipedream, folded 2 a device", "v", two, P),
      _row("pipedream-interleaved", "loop",
           make("pipedream-interleaved", num_stages=2 * P, num_microbatches=1,
                num_minibatches=B, num_devices=P), P),
      _row("pipedream-v", "v", make("pipedream-v", num_stages=2 * P,
                                    num_microbatches=1, num_minibatches=B),
           P),
      _row("V, in-flight admission, K = P", "v",
           in_flight_admission(2 * P, P), P),
      _row("V, in-flight admission, K = P + 1", "v",
           in_flight_admission(2 * P, P + 1), P),
  ]


def main(argv):
  del argv
  print("| schedule | placement | P | S | versions per device | max | "
        "in flight | steady bubble | staleness d_s per stage | max d_s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for P in map(int, _DEVICES.value):
    print("\n".join(rows(P)))


if __name__ == "__main__":
  app.run(main)
