"""What a zero-bubble weight-gradient task costs, split and unsplit.

One stage of the executor benchmarks' MLP (`layers` blocks `H -> H`, b
examples), on one CPU device: the compiled FLOPs (`cost_analysis`) and the
median time of

- BI: the input gradient from the forward's kept pullback, which also keeps
  the weight ops' output cotangents (`split_backward.input_gradient`);
- BW, split: the weight gradient from the kept op inputs and BI's op
  cotangents (`split_backward.weight_gradient`);
- BW, whole pullback: the weight gradient of the forward's whole `jax.vjp`
  pullback, the input cotangent dropped (what BW ran before the split);
- B: the whole pullback, both gradients (a fused backward).

Each task runs `repeats` times in a row, the tasks in turn, for `rounds`
rounds (calls of different programs interleaved one by one ran slower here
for reasons unrelated to their work, e.g. the split BW 1.45 ms interleaved
against 0.68 ms in a row); the time is the median over rounds of each
block's median.

  PYTHONPATH=. .venv/bin/python experiments/split_backward_cost.py \
      [--hidden 512] [--layers 2] [--batch 32] [--repeats 100] [--rounds 5]
"""

import argparse
import time

import executor_common as common  # pylint: disable=g-bad-import-order

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import split_backward as split_lib


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--layers", type=int, default=2, help="per stage")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=100,
                      help="calls of a task in a row, of which the median")
  parser.add_argument("--rounds", type=int, default=5,
                      help="rounds of every task; the median over rounds")
  args = parser.parse_args()
  staged = common.make_model(4, args.hidden, args.layers)
  fn, p = staged.stage_fns[1], staged.stage_params[1]
  x = jax.random.normal(jax.random.key(0), (args.batch, args.hidden))
  cotangent = jnp.ones_like(x)
  split = split_lib.analyse(lambda p, x, t: fn(p, x), p, x, None)
  _, (pullback, kept) = split_lib.forward(split, p, x, None)
  _, op_cots = split_lib.input_gradient(split, pullback, cotangent)
  _, whole = jax.vjp(fn, p, x)
  tasks = {
      "BI": (lambda pb, c: split_lib.input_gradient(split, pb, c),
             (pullback, cotangent)),
      "BW, split": (lambda *a: split_lib.weight_gradient(split, *a),
                    (p, x, None, kept, op_cots)),
      "BW, whole pullback": (lambda pb, c: pb(c)[0], (whole, cotangent)),
      "B": (lambda pb, c: pb(c), (whole, cotangent)),
  }
  compiled = {k: (jax.jit(f).lower(*a).compile(), a)
              for k, (f, a) in tasks.items()}
  times = {k: [] for k in compiled}
  for _ in range(args.rounds):  # alternated blocks of repeats
    for k, (c, a) in compiled.items():
      block = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(c(*a))
        block.append(time.perf_counter() - start)
      times[k].append(np.median(block))
  print(f"{'task':20s} {'MFLOPs':>8s} {'ms':>7s}")
  for k, (c, _) in compiled.items():
    flops = c.cost_analysis()["flops"]
    print(f"{k:20s} {flops / 1e6:8.1f} {1e3 * np.median(times[k]):7.3f}")


if __name__ == "__main__":
  main()
