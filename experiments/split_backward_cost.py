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

Each task runs `--repeats` times in a row, the tasks in turn, for `--rounds`
rounds (calls of different programs interleaved one by one ran slower here
for reasons unrelated to their work, e.g. the split BW 1.45 ms interleaved
against 0.68 ms in a row); the time is the median over rounds of each
block's median.

  PYTHONPATH=. .venv/bin/python experiments/split_backward_cost.py \
      [--hidden=512] [--layers=2] [--batch=32] [--repeats=100] [--rounds=5] \
      [--out_dir=DIR]
"""

import time

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import harness
from stalepipe.pipeline import split_backward as split_lib

_ROUNDS = flags.DEFINE_integer(
    "rounds", 5, "Rounds of every task; the median over rounds.")
# Here --repeats is calls of a task in a row, of which the median.
flags.FLAGS.set_default("repeats", 100)


def main(argv):
  del argv
  hidden, batch = common.HIDDEN.value, common.BATCH.value
  staged = common.make_model(4, hidden, common.LAYERS.value)
  fn, p = staged.stage_fns[1], staged.stage_params[1]
  x = jax.random.normal(jax.random.key(0), (batch, hidden))
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
  for _ in range(_ROUNDS.value):  # alternated blocks of repeats
    for k, (c, a) in compiled.items():
      block = []
      for _ in range(harness.REPEATS.value):
        start = time.perf_counter()
        jax.block_until_ready(c(*a))
        block.append(time.perf_counter() - start)
      times[k].append(np.median(block))
  print(f"{'task':20s} {'MFLOPs':>8s} {'ms':>7s}")
  results = {}
  for k, (c, _) in compiled.items():
    results[k] = {"flops": float(c.cost_analysis()["flops"]),
                  "median_s": harness.median(times[k])}
    print(f"{k:20s} {results[k]['flops'] / 1e6:8.1f} "
          f"{1e3 * results[k]['median_s']:7.3f}")
  harness.record("split_backward_cost", results)


if __name__ == "__main__":
  harness.run(main)
