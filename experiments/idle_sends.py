"""What grouping a window's ticks by the directions that move would buy.

Every tick of the slots' tick sends both directions along 'stage' (no
`ppermute` under a `cond`: docs/executor.md, "Folding"). The tables are
static, so a window's ticks could be cut into runs in which the same
directions move, each run its own loop sending only those. For each
schedule: the window's ticks, the runs (one compiled loop body each), the
sends a window makes now (2 a tick) and the sends it needs (a direction in
a tick where some stage of some window files a row sent that way).

  python experiments/idle_sends.py

Results: `idle_sends.json` under `--out_dir`, which docs/executor.md quotes.
"""

from absl import flags

import harness
import stalepipe as sp
from stalepipe.pipeline import program as program_lib

RUNS = (("gpipe", 4, 8), ("1f1b", 4, 8), ("zb-h1", 4, 8), ("pipedream", 4, 1),
        ("interleaved-1f1b", 8, 8), ("zb-v", 8, 8), ("dualpipev", 8, 8),
        ("pipedream-v", 8, 1))
MINIBATCHES = flags.DEFINE_integer("minibatches", 2, "Minibatches a window.")


def row(name: str, S: int, M: int) -> dict:
  options = ({"num_devices": S // 2} if sp.schedules.takes_num_devices(name)
             else {})
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=MINIBATCHES.value, **options)
  t = program_lib.compile_program(schedule).tables
  forward = (t.recv_forward >= 0).any(axis=(0, 2))
  backward = (t.recv_backward >= 0).any(axis=(0, 2))
  moves = list(zip(forward, backward))
  return {"stages": S, "microbatches": M, "ticks": len(moves),
          "runs": 1 + sum(a != b for a, b in zip(moves, moves[1:])),
          "sends_now": 2 * len(moves),
          "sends_needed": int(forward.sum() + backward.sum())}


def main(argv):
  del argv
  rows = {name: row(name, S, M) for name, S, M in RUNS}
  print(f"{'schedule':18s} {'S':>3s} {'M':>3s} {'ticks':>6s} {'runs':>5s} "
        f"{'sends now':>10s} {'needed':>7s}")
  for name, r in rows.items():
    print(f"{name:18s} {r['stages']:3d} {r['microbatches']:3d} "
          f"{r['ticks']:6d} {r['runs']:5d} {r['sends_now']:10d} "
          f"{r['sends_needed']:7d}")
  harness.record("idle_sends", {"minibatches": MINIBATCHES.value,
                                "rows": rows})


if __name__ == "__main__":
  harness.run(main)
