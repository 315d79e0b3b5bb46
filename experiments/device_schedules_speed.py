"""Device-level schedules on the (2 data x 4 stage) emulated mesh, against 1F1B
and the MaxText-style GPipe, normalised by the work.

One model of 8 x `layers` blocks `H -> H` (the executor benchmarks' MLP):
1F1B, zb-h1 and the MaxText-style baseline (`baseline_gpipe.py`) run it as 4
stages of 2 x `layers` blocks, one a device; interleaved-1f1b, zb-v and
dualpipev as 8 chunks of `layers` blocks, two a device (loop or V
placement). Every run does the same work a minibatch (M micro-batches of the
same examples through the same blocks), so the step time per minibatch over
the baseline's compares the executors directly. Interleaved rounds (one
repeat of every run, then the next), medians; with `remat="residuals"`.
Also, without timing, each schedule's device bubble (its table) and its
closed form.

  cd experiments && python device_schedules_speed.py [--repeats=7] [--lanes] [--out_dir=DIR]

On 8 emulated CPU devices sharing the host's cores a bubble is not idle time
(a device's idle tick lets another device's work run): read the ratios as
what the executor costs for the work, not as pipeline speed.
"""

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

P = 4  # devices on 'stage'
MINIBATCHES = flags.DEFINE_integer("minibatches", 2,
                                   "Minibatches per executor window.")
RUNS = (("1f1b", P), ("zb-h1", P), ("interleaved-1f1b", 2 * P),
        ("zb-v", 2 * P), ("dualpipev", 2 * P))
LANES = flags.DEFINE_bool(
    "lanes", False, "Also run each device-level schedule with the lanes' tick "
    "(`Pipeline(tick='lanes')`, rows `<name>@lanes`); the others run "
    "tick='auto', here the slots' tick.")
flags.FLAGS.set_default("repeats", 7)
flags.FLAGS.set_default("micro", 8)  # DualPipeV needs M >= 2P


def closed_form(name: str, M: int) -> float | None:
  """The device bubble a minibatch's table has in closed form, or None."""
  if name == "interleaved-1f1b":
    return sp.theory.interleaved_1f1b_bubble(P, 2, M) / (
        1 + sp.theory.interleaved_1f1b_bubble(P, 2, M))
  if name == "zb-h1":
    return sp.theory.zero_bubble_h1_bubble(P, M)
  if name == "1f1b":
    return sp.theory.gpipe_bubble(P, M)
  if name == "zb-v":  # 3 tasks of unit cost per chunk and micro-batch
    return 1 - 3 * 2 * M / sp.theory.zero_bubble_v_makespan(P, M)
  return None  # DualPipeV: the README gives idle time, not a fraction


def build(name, stages, mesh, x, y, layers):
  base, _, tick = name.partition("@")
  schedule = common.make_schedule(base, stages, x.shape[1], x.shape[0],
                                  devices=P)
  staged = common.make_model(stages, common.HIDDEN.value, layers)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.01), mesh, remat="residuals",
                           tick=tick or "auto")
  run, _, _ = common.window_runner(pipe, staged.stage_params, x, y)
  one = schedule.with_minibatches(1)
  bubble = (one.device_bubble_fraction if one.placement
            else one.bubble_fraction)
  return run, {"placement": pipe.placement.name, "bubble": bubble,
               "closed_form_bubble": closed_form(base, x.shape[1]),
               "ticks_a_window": int(pipe.program.tables.kind.shape[1])}


def main(argv):
  del argv
  H, b, M, B = (common.HIDDEN.value, common.BATCH.value, common.MICRO.value,
                MINIBATCHES.value)
  L = common.LAYERS.value
  mesh = jax.make_mesh((2, P), ("data", "stage"))
  x, y = common.make_batch(B, M, 2 * b, H)
  runs, info = {}, {}
  lanes = [(f"{n}@lanes", s) for n, s in RUNS if s > P] if LANES.value else []
  for name, stages in RUNS + tuple(lanes):
    runs[name], info[name] = build(name, stages, mesh, x, y,
                                   8 * L // stages)
  baseline = "baseline GPipe (MaxText style)"
  runs[baseline] = common.baseline_run(common.make_model(P, H, 2 * L), mesh,
                                       x[0], y[0])
  samples = common.interleaved_samples(runs)
  per_minibatch = {k: harness.median(v) / (1 if k == baseline else B)
                   for k, v in samples.items()}
  rows = {}
  print(f"{'run':18s} {'placement':>11s} {'ms/minibatch':>12s} "
        f"{'x baseline':>10s} {'x 1f1b':>7s} {'bubble (closed form)':>21s}")
  for name, i in info.items():
    rows[name] = {**i, "ms_per_minibatch": 1e3 * per_minibatch[name],
                  "over_baseline": per_minibatch[name] / per_minibatch[baseline],
                  "over_1f1b": per_minibatch[name] / per_minibatch["1f1b"]}
    cf = i["closed_form_bubble"]
    print(f"{name:18s} {i['placement']:>11s} "
          f"{rows[name]['ms_per_minibatch']:12.1f} "
          f"{rows[name]['over_baseline']:10.2f} {rows[name]['over_1f1b']:7.2f} "
          f"{i['bubble']:9.3f} ({'-' if cf is None else f'{cf:.3f}'})")
  print(f"{baseline:18s} {'':>11s} {1e3 * per_minibatch[baseline]:12.1f} "
        f"{1.0:10.2f}")
  harness.record("device_schedules_speed", {
      "config": common.config("hidden", "layers", "batch", "micro",
                              "minibatches", "repeats", "lanes"),
      "median_s": {k: harness.median(v) for k, v in samples.items()},
      "rows": rows})


if __name__ == "__main__":
  harness.run(main)
