"""The weight versions a device holds, one ring a slot against a pooled stash.

Asynchronous pipelines with two chunks a device, on the emulated (1 x P)
mesh: pipedream-v and pipedream-interleaved (their own V and loop
placements, one task a device a tick), and stage-level PipeDream folded two
a device on the V and on the consecutive placement. Each runs with
`Pipeline(stash="slots")` (one ring a slot, each as deep as the deepest
stage in that slot on any device) and `stash="pooled"` (`pool.py`: one pool
a device, `Program.pool_size` rows). For each, the schedule's figure (the
most versions one device keeps at once, `Schedule.device_stash_depth` over
48 minibatches), the rows each executor holds, the bytes of one device's
shard of the weight versions as placed, the compiled step's peak (its
arguments and temporaries, `memory_analysis()`, one device), and the step
time pooled over slots
(interleaved rounds, medians; the same window, the same numbers: the tests
check them bit for bit).

  cd experiments && python pooled_stash.py [--devices=4] [--repeats=7]

Results: `pooled_stash.json` under `--out_dir`, which docs/executor.md quotes.
"""

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import optax

import harness
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

DEVICES = flags.DEFINE_integer("devices", 4, "P, devices on 'stage'.")
RUNS = (("pipedream-v", None), ("pipedream-interleaved", None),
        ("pipedream", "v"), ("pipedream", "consecutive"))


def build(name, placement, stash, x, y):
  P = DEVICES.value
  schedule = common.make_schedule(name, 2 * P, 1, x.shape[0], devices=P)
  staged = common.make_model(2 * P, common.HIDDEN.value, common.LAYERS.value)
  mesh = jax.make_mesh((1, P), ("data", "stage"), devices=jax.devices()[:P])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.01), mesh, placement=placement,
                           stash=stash)
  run, box, step_fn = common.window_runner(pipe, staged.stage_params, x, y)
  rows = (pipe.program.pool_size if pipe.pooled else
          max(sum(pipe.program.ring_sizes[s] for s in stages)
              for stages in pipe.placement.stages))
  long = schedule.with_minibatches(48)
  figure = (max(long.device_stash_depth) if long.num_devices else
            max(sum(long.stash_depth[s] for s in stages)
                for stages in pipe.placement.stages))
  memory = step_fn.memory_analysis()
  return run, {"rows": rows, "figure": figure,
               "weight_bytes": common.shard_bytes(
                   [r.params for r in box[0].ring]),
               "peak_bytes": (memory.argument_size_in_bytes
                              + memory.temp_size_in_bytes)}


def main(argv):
  del argv
  H, b = common.HIDDEN.value, common.BATCH.value
  x, y = common.make_batch(2, 1, b, H)
  runs, info = {}, {}
  for name, placement in RUNS:
    for stash in ("slots", "pooled"):
      key = f"{name}@{placement or 'own'}@{stash}"
      runs[key], info[key] = build(name, placement, stash, x, y)
  samples = common.interleaved_samples(runs)
  rows = {}
  print(f"{'schedule':22s} {'placement':>11s} {'figure':>6s} "
        f"{'rows slots':>10s} {'rows pooled':>11s} {'MiB slots':>9s} "
        f"{'MiB pooled':>10s} {'peak slots':>10s} {'peak pooled':>11s} "
        f"{'time pooled/slots':>17s}")
  for name, placement in RUNS:
    key = f"{name}@{placement or 'own'}"
    slots, pooled = info[f"{key}@slots"], info[f"{key}@pooled"]
    ratio = (harness.median(samples[f"{key}@pooled"])
             / harness.median(samples[f"{key}@slots"]))
    rows[key] = {"figure": slots["figure"], "rows_slots": slots["rows"],
                 "rows_pooled": pooled["rows"],
                 "bytes_slots": slots["weight_bytes"],
                 "bytes_pooled": pooled["weight_bytes"],
                 "peak_slots": slots["peak_bytes"],
                 "peak_pooled": pooled["peak_bytes"],
                 "time_pooled_over_slots": ratio}
    print(f"{name:22s} {placement or 'own':>11s} {slots['figure']:6d} "
          f"{slots['rows']:10d} {pooled['rows']:11d} "
          f"{slots['weight_bytes'] / 2**20:9.2f} "
          f"{pooled['weight_bytes'] / 2**20:10.2f} "
          f"{slots['peak_bytes'] / 2**20:10.2f} "
          f"{pooled['peak_bytes'] / 2**20:11.2f} {ratio:17.3f}")
  harness.record("pooled_stash", {
      "config": common.config("hidden", "layers", "batch", "devices",
                              "repeats"),
      "median_s": {k: harness.median(v) for k, v in samples.items()},
      "rows": rows})


if __name__ == "__main__":
  harness.run(main)
