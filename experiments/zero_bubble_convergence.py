"""Asynchronous zero-bubble against zb-h1 and PipeDream: convergence.

zb-async lets a stage's weight-gradient tasks run past the next minibatch's
forwards (no flush): every task of minibatch p reads version max(0, p - 1),
so each update uses a gradient 1 update stale, with a stash of 2 versions
per stage (docs/schedules.md). This trains the default MLP on digits through
launch.py with zb-h1 (synchronous), zb-async, zb-async whose staleness
stalepipe.optim compensates (SAPipe's full delay compensation for the stash
the gradient used, `stale_params`), and asynchronous PipeDream, over seeds,
and reports the final training loss and test accuracy.

  .venv/bin/python experiments/zero_bubble_convergence.py --steps 400 --seeds 3
"""

import argparse
import os
import tempfile

import numpy as np

import launch_common

_DC = ("(('delay_compensation', {'lam': 0.2, 'form': 'full', "
       "'adaptive': 'current', 'delay': 0}),)")
RUNS = {
    "zb-h1": ("zb_h1.py", {}),
    "zb-async": ("zb_async.py", {}),
    "zb-async + DC": ("zb_async.py", {"transforms": _DC}),
    "pipedream": ("pipedream.py", {}),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args()
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in range(args.seeds):
      for name, (config, overrides) in RUNS.items():
        summary = launch_common.run(config, {
            "seed": seed, "dataset_kwargs.seed": seed,
            "num_steps": args.steps, "num_microbatches": 4,
            "optimizer_kwargs.learning_rate": args.lr, **overrides},
            os.path.join(tmp, f"{name}_{seed}".replace(" ", "_")))
        row = ((np.nan, np.nan) if summary is None else
               (summary["final_training_loss"], summary["test_accuracy"]))
        results.setdefault(name, []).append(row)
        print(f"seed {seed} {name:14s} loss {row[0]:.4f} "
              f"accuracy {row[1]:.4f}", flush=True)
  print(f"\n| schedule | final loss | test accuracy |  (lr {args.lr}, "
        f"{args.steps} steps, {args.seeds} seeds)\n|---|---|---|")
  for name, rows in results.items():
    loss, acc = np.array(rows).T
    print(f"| {name} | {loss.mean():.4f} ± {loss.std():.4f} | "
          f"{acc.mean():.4f} ± {acc.std():.4f} |")


if __name__ == "__main__":
  main()
