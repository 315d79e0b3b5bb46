"""Overhead of the executor against its stages' compute and a GPipe baseline.

On 8 emulated CPU devices (2 data x 4 stages) and one MLP (4 identical stages
of `layers` blocks `H -> H`), times in one process, interleaved (one repeat
of every run, then the next repeat), after a warm-up:

- ours: one window of the executor for `gpipe` and `pipedream` (B=1
  minibatch of M micro-batches: M forwards and M backwards per stage, one
  update per stage), and each with its table cut down (all idle; forwards
  only) to see what the per-tick machinery costs;
- the MaxText / JAX-docs style GPipe step (`baseline_gpipe.py`);
- alone: each stage's forward and backward (as the executor runs them: the
  backward recomputes the forward) jitted on one device; their sum over the
  tasks of one window is the compute a step cannot avoid.

Reports medians and `overhead = step / sum of the stages' compute alone`.
`--patched=FILE` also times a modified copy of `stalepipe/pipeline/
executor.py` in the same run (A/B of a proposed speed-up).

  .venv/bin/python experiments/executor_overhead.py [--repeats=15] \
      [--out_dir=DIR] [--write_figures] [--patched=FILE]
"""

import importlib.util
import itertools
import time

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

S = 4
_PATCHED = flags.DEFINE_string(
    "patched", None, "A modified copy of executor.py to time beside it.")
flags.FLAGS.set_default("repeats", 15)


def alone_costs(staged, micro: int, batch: int, hidden: int, repeats: int):
  """Median seconds of each stage's F and B on one device."""
  x = jnp.ones((batch, hidden), jnp.float32)
  y = jnp.zeros((batch,), jnp.int32)
  out = []
  for s, (fn, p) in enumerate(zip(staged.stage_fns, staged.stage_params)):
    if s == S - 1:
      objective = lambda p, x, fn=fn: cross_entropy(fn(p, x), y) / micro
      forward = jax.jit(lambda p, x, fn=fn: cross_entropy(fn(p, x), y))
      backward = jax.jit(jax.grad(objective, (0, 1)))
      args_b = (p, x)
    else:
      forward = jax.jit(fn)
      backward = jax.jit(lambda p, x, ct, fn=fn: jax.vjp(fn, p, x)[1](ct))
      args_b = (p, x, x)
    times = {}
    for kind, f, a in (("F", forward, (p, x)), ("B", backward, args_b)):
      jax.block_until_ready(f(*a))
      samples = []
      for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
          r = f(*a)
        jax.block_until_ready(r)
        samples.append((time.perf_counter() - t) / 10)
      times[kind] = float(np.median(samples))
    out.append(times)
  return out


def main(argv):
  del argv
  H, b, M = common.HIDDEN.value, common.BATCH.value, common.MICRO.value
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  staged = common.make_model(S, H, common.LAYERS.value)
  x, y = common.make_batch(1, M, 2 * b, H)

  executors = {"": executor}
  if _PATCHED.value:
    spec = importlib.util.spec_from_file_location("patched", _PATCHED.value)
    executors[" [patched]"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(executors[" [patched]"])
  runs, states, tasks = {}, {}, {}
  for (suffix, module), schedule in itertools.product(
      executors.items(), ("gpipe", "pipedream")):
    name = schedule + suffix
    pipe = module.Pipeline(staged.stage_fns, cross_entropy,
                           common.make_schedule(schedule, S, M, 1),
                           optax.sgd(0.01), mesh)
    step_fn, states[name], step_args = common.step_function(
        pipe, pipe.init(staged.stage_params), x, y)
    program = pipe.program
    tasks[name] = {"ticks": int(program.tables.kind.shape[1]),
                   **{k: int(np.sum(program.tables.kind[-1]
                                    == program.kind_code(k)))
                      for k in program.kinds}}
    variants = {name: program.tables,
                f"{name}, idle table": common.cut_table(program, ()),
                f"{name}, forwards only": common.cut_table(program, ("F",))}
    for label, tables in variants.items():
      call_args = common.with_tables(step_args, tables)

      def run(name=name, call_args=call_args, step_fn=step_fn):
        states[name], metrics = step_fn(states[name], *call_args)
        jax.block_until_ready(metrics)

      runs[label] = run

  runs["baseline GPipe (MaxText style)"] = common.baseline_run(
      staged, mesh, x[0], y[0])
  samples = common.interleaved_samples(runs)
  alone = alone_costs(staged, M, b, H, harness.REPEATS.value)
  alone_sum = sum(M * (c["F"] + c["B"]) for c in alone)
  config = common.config("hidden", "layers", "batch", "micro", "repeats",
                         "patched")
  results = {"config": config, "tasks": tasks, "alone": alone,
             "alone_sum_s": alone_sum, "runs": {}}
  for label, times in samples.items():
    median = harness.median(times)
    results["runs"][label] = {
        "median_s": median, "q25_s": float(np.percentile(times, 25)),
        "q75_s": float(np.percentile(times, 75)),
        "over_alone_sum": median / alone_sum}
    print(f"{label:34s} {1e3 * median:8.1f} ms   x{median / alone_sum:5.2f}"
          " of the stages' compute alone")
  print(f"{'sum of stages alone':34s} {1e3 * alone_sum:8.1f} ms  "
        f"(F {1e3 * alone[1]['F']:.2f} ms, B {1e3 * alone[1]['B']:.2f} ms "
        "per task, stage 1)")
  baseline = results["runs"]["baseline GPipe (MaxText style)"]["median_s"]
  for name in tasks:
    idle = results["runs"][f"{name}, idle table"]["median_s"]
    tasks[name]["idle_tick_ms"] = 1e3 * idle / tasks[name]["ticks"]
    tasks[name]["over_baseline"] = results["runs"][name]["median_s"] / baseline
    print(f"{name}: idle tick {tasks[name]['idle_tick_ms']:.2f} ms, "
          f"step over baseline {tasks[name]['over_baseline']:.2f}")
  harness.record("executor_overhead", results)
  path = harness.figure_path("executor_overhead.png")
  if path:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    labels = list(results["runs"]) + ["stages' compute alone"]
    values = [1e3 * r["median_s"] for r in results["runs"].values()]
    values.append(1e3 * alone_sum)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(labels[::-1], values[::-1], color="tab:blue")
    ax.set_xlabel("ms per step (median), 8 emulated CPU devices")
    ax.set_title(f"S={S}, M={M}, H={H}, b={b} per replica, 2 replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
  harness.run(main)
