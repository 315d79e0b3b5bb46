"""Zero-bubble schedules in one SPMD program, against the MaxText-style GPipe.

On 8 emulated CPU devices (2 data x 4 stages), the executor benchmarks' MLP
(4 identical stages of `layers` blocks `H -> H`), in one process, interleaved
(one repeat of every run, then the next), after a warm-up:

- 1f1b, zb-h1 and zb-h2, each with `remat="recompute"` (a backward task
  recomputes its forward) and `remat="residuals"` (the forward keeps its
  pullback), each over a window of B minibatches of M micro-batches; the step
  time per minibatch over the baseline's step (`baseline_gpipe.py`, one
  minibatch of the same M micro-batches, its backward by autodiff of the
  whole loop, which keeps every residual);
- the idle tick: the same window with every task made idle, over its ticks;
- zb-h1 and zb-h2 with residuals and the backward split (BI keeps the weight
  ops' output cotangents, BW computes only the weight gradients;
  `split_backward.py`) against the same with BW calling the whole pullback
  (`WholePullbackBW`, as before the split), in the same run;
- zb-h1 with residuals under each tick lowering (`dispatch.LOWERINGS`).

Also, without timing: each schedule's measured bubble against its closed
form (`stalepipe.theory`), and its activation buffers (per device: inputs,
cotangents, kept residuals and a split backward's op cotangents, from the
arrays) with the compiled temp memory, as a ratio to 1f1b's (Qi et al. claim
1x for ZB-H1, 2x for ZB-H2).

  .venv/bin/python experiments/zero_bubble.py [--repeats=15] \
      [--skip_lowerings] [--layout=packed] [--out_dir=DIR]
"""

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import dispatch
from stalepipe.pipeline import executor
from stalepipe.pipeline import packing
from stalepipe.pipeline import residuals as residuals_lib
from stalepipe.pipeline import trace_names

S = 4
SCHEDULES = ("1f1b", "zb-h1", "zb-h2")
REMATS = ("recompute", "residuals")

MINIBATCHES = flags.DEFINE_integer("minibatches", 2,
                                   "Minibatches per executor window.")
LAYOUT = flags.DEFINE_enum("layout", "packed", tuple(packing.LAYOUTS),
                           "The executor's weight layout (packing.LAYOUTS).")
_SKIP_LOWERINGS = flags.DEFINE_bool(
    "skip_lowerings", False, "No rows for the other tick lowerings.")
flags.FLAGS.set_default("repeats", 15)


def closed_form_bubble(name: str, M: int, B: int) -> float:
  """The closed form of the bubble a stream of B minibatches measures, in
  the schedule's own ticks (unit F, B, BI and BW)."""
  if name == "zb-h1":
    return sp.theory.zero_bubble_h1_bubble(S, M)
  if name == "zb-h2":
    return sp.theory.zero_bubble_h2_bubble(S, M, B)
  return sp.theory.gpipe_bubble(S, M)  # 1F1B with flushes: GPipe's


class WholePullbackBW(executor.Pipeline):
  """Ablation: BI and BW each call the forward's whole pullback and keep one
  of its outputs, as before the split backward (`split_backward.py`); BW
  re-derives the cotangent chain BI computed."""

  def _forwards(self, stage_inputs, target):
    last = len(self.stage_fns) - 1
    return None, tuple(residuals_lib.vjp(fn, self._loss_fn, s == last)
                       for s, fn in enumerate(self._fns))


def build(name, remat, lowering, staged, mesh, x, y, pipeline=None,
          layout="packed", with_ops=False):
  """A run of one window, its tables' tick count and its memory figures
  (`with_ops`: also each compiled op's task, `trace_names.task_of_ops`)."""
  B, M = x.shape[:2]
  schedule = common.make_schedule(name, S, M, B)
  pipe = (pipeline or executor.Pipeline)(
      staged.stage_fns, cross_entropy, schedule, optax.sgd(0.01), mesh,
      remat=remat, lowering=lowering, layout=layout)
  step_fn, state, args = common.step_function(
      pipe, pipe.init(staged.stage_params), x, y)
  idle_args = common.with_tables(args, common.cut_table(pipe.program, ()))
  box = {"state": state}

  def run(call_args):
    box["state"], metrics = step_fn(box["state"], *call_args)
    jax.block_until_ready(metrics)

  memory = step_fn.memory_analysis()
  info = {"ticks": int(pipe.program.tables.kind.shape[1]),
          "bubble": schedule.with_minibatches(6 * B).bubble_fraction,
          "closed_form_bubble": closed_form_bubble(name, M, 6 * B),
          "max_in_flight": list(schedule.with_minibatches(6 * B).max_in_flight),
          "buffer_slots": pipe.program.num_slots,
          "activation_bytes": common.shard_bytes(state.buffers),
          "residual_bytes": common.shard_bytes([b.residuals for b in state.buffers]),
          "op_cotangent_bytes": common.shard_bytes([b.op_cotangents for b in state.buffers]),
          "temp_bytes": int(memory.temp_size_in_bytes)}
  if with_ops:
    info["op_tasks"] = trace_names.task_of_ops(step_fn.as_text())
  return (lambda: run(args)), (lambda: run(idle_args)), info


def main(argv):
  del argv
  H, b, M, B = (common.HIDDEN.value, common.BATCH.value, common.MICRO.value,
                MINIBATCHES.value)
  layout = LAYOUT.value
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  staged = common.make_model(S, H, common.LAYERS.value)
  x, y = common.make_batch(B, M, 2 * b, H)

  runs, info = {}, {}
  for name in SCHEDULES:
    for remat in REMATS:
      label = f"{name}, {remat}"
      runs[label], runs[f"{label}, idle table"], info[label] = build(
          name, remat, "nested_switch", staged, mesh, x, y, layout=layout)
  for name in ("zb-h1", "zb-h2"):
    label = f"{name}, residuals, whole-pullback BW"
    runs[label], _, info[label] = build(name, "residuals", "nested_switch",
                                        staged, mesh, x, y, WholePullbackBW,
                                        layout)
  for lowering in dispatch.LOWERINGS:
    if lowering != "nested_switch" and not _SKIP_LOWERINGS.value:
      label = f"zb-h1, residuals, {lowering}"
      runs[label], _, info[label] = build("zb-h1", "residuals", lowering,
                                          staged, mesh, x, y, layout=layout)

  baseline = "baseline GPipe (MaxText style)"
  runs[baseline] = common.baseline_run(staged, mesh, x[0], y[0])
  samples = common.interleaved_samples(runs)
  median = {k: harness.median(v) for k, v in samples.items()}
  per_minibatch = {k: v / (1 if k == baseline else B) for k, v in median.items()}
  config = common.config("hidden", "layers", "batch", "micro", "minibatches",
                         "repeats", "layout", "skip_lowerings")
  results = {"config": config, "median_s": median, "info": info, "rows": {}}
  print(f"{'run':38s} {'ms/minibatch':>12s} {'x baseline':>10s} "
        f"{'idle tick':>9s} {'bubble':>13s} {'act. bytes':>10s}")
  act_1f1b = info["1f1b, recompute"]["activation_bytes"]
  for label, i in info.items():
    row = {"ms_per_minibatch": 1e3 * per_minibatch[label],
           "over_baseline": per_minibatch[label] / per_minibatch[baseline],
           "activation_over_1f1b": i["activation_bytes"] / act_1f1b}
    if f"{label}, idle table" in median:
      row["idle_tick_ms"] = 1e3 * median[f"{label}, idle table"] / i["ticks"]
    results["rows"][label] = row
    print(f"{label:38s} {row['ms_per_minibatch']:12.1f} "
          f"{row['over_baseline']:10.2f} "
          f"{row.get('idle_tick_ms', float('nan')):8.2f}ms "
          f"{i['bubble']:.3f} ({i['closed_form_bubble']:.3f}) "
          f"{row['activation_over_1f1b']:9.2f}x")
  print(f"{baseline:38s} {1e3 * per_minibatch[baseline]:12.1f}       1.00")
  harness.record("zero_bubble", results)


if __name__ == "__main__":
  harness.run(main)
