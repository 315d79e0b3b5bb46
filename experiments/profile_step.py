"""Where a window step's time goes, op by op, from a profiler trace.

Runs one schedule's window (the zero-bubble benchmark's model and mesh:
8 emulated CPU devices, 2 data x 4 stages, H x H stages) or the MaxText-style
baseline under `jax.profiler`, reads the Perfetto trace back and prints, per
compiled op (numbered clones merged), its calls per window, median, mean and
90th-percentile duration and its share of all op time. Durations are per
device thread: on 8 emulated devices sharing the cores they include the time
a thread waits for the intra-op pool (XLA:CPU splits large loop fusions into
`outer_dimension_partitions`), so a heavy tail (mean well above median) is
waiting, not work.

  PYTHONPATH=. .venv/bin/python experiments/profile_step.py \
      [--schedule=zb-h1] [--remat=residuals] [--layout=packed] [--batch=32] \
      [--top=15] [--out_dir=DIR]
  PYTHONPATH=. .venv/bin/python experiments/profile_step.py --schedule=baseline

The model's flags (`--hidden`, `--layers`, `--batch`, `--micro`,
`--minibatches`, `--layout`) are `zero_bubble.py`'s.
"""

import collections
import glob
import gzip
import json
import re
import tempfile

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import numpy as np

import harness
import zero_bubble

# Trace events that contain ops or wait for others, not ops themselves.
_CONTAINERS = re.compile(
    r"^(ThunkExecutor|Wait|conditional|while|Rendezvous|\$|end:|"
    r"InvokeRendezvous|SlinkyThreadPool|call|Thunk|PjitFunction|"
    r"CommonPjRt|ppermute|psum|all-reduce)")

_SCHEDULE = flags.DEFINE_string("schedule", "zb-h1",
                                "A schedule name, or 'baseline'.")
_REMAT = flags.DEFINE_enum("remat", "residuals", zero_bubble.REMATS,
                           "The executor's remat.")
_WINDOWS = flags.DEFINE_integer("windows", 3, "Windows traced.",
                                lower_bound=1)
_TOP = flags.DEFINE_integer("top", 15, "Ops listed.", lower_bound=1)


def op_durations(trace_dir: str, op_tasks: dict[str, str] | None = None
                 ) -> tuple[dict[str, list[float]], dict[str, float]]:
  """Op name (clone numbers dropped) -> durations in microseconds, and the
  total per task (`op_tasks`: instruction -> task, from the compiled text;
  ops under no task's scope count as "(tick)")."""
  path = glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True)[0]
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  durations = collections.defaultdict(list)
  by_task = collections.defaultdict(float)
  for event in events:
    if event.get("ph") != "X":
      continue
    name = re.sub(r"\.clone|\.\d+", "", event["name"])
    if not _CONTAINERS.match(name):
      durations[name].append(float(event.get("dur", 0)))
      by_task[(op_tasks or {}).get(event["name"], "(tick)")] += float(
          event.get("dur", 0))
  return durations, by_task


def main(argv):
  del argv
  windows, hidden = _WINDOWS.value, common.HIDDEN.value
  mesh = jax.make_mesh((2, zero_bubble.S), ("data", "stage"))
  staged = common.make_model(zero_bubble.S, hidden, common.LAYERS.value)
  x, y = common.make_batch(zero_bubble.MINIBATCHES.value, common.MICRO.value,
                           2 * common.BATCH.value, hidden)
  info = {}
  if _SCHEDULE.value == "baseline":
    run = common.baseline_run(staged, mesh, x[0], y[0])
  else:
    run, _, info = zero_bubble.build(_SCHEDULE.value, _REMAT.value,
                                     "nested_switch", staged, mesh, x, y,
                                     layout=zero_bubble.LAYOUT.value,
                                     with_ops=True)
  for _ in range(3):
    run()
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(windows):
      run()
    jax.profiler.stop_trace()
    durations, by_task = op_durations(trace_dir, info.get("op_tasks"))
  total = sum(sum(v) for v in durations.values())
  print(f"{_SCHEDULE.value}: op time {total / windows / 1e3:.1f} ms per "
        "window, summed over device threads")
  print(f"{'op':40s} {'calls':>6s} {'median':>8s} {'mean':>8s} {'p90':>8s} "
        f"{'share':>6s}")
  ranked = sorted(durations.items(), key=lambda kv: -sum(kv[1]))
  ops = {}
  for name, values in ranked[:_TOP.value]:
    v = np.asarray(values)
    ops[name] = {"calls_per_window": len(v) // windows,
                 "median_us": float(np.median(v)), "mean_us": float(v.mean()),
                 "p90_us": float(np.percentile(v, 90)),
                 "share": float(v.sum() / total)}
    print(f"{name[:40]:40s} {ops[name]['calls_per_window']:6d} "
          f"{ops[name]['median_us']:6.0f}us {ops[name]['mean_us']:6.0f}us "
          f"{ops[name]['p90_us']:6.0f}us {100 * ops[name]['share']:5.1f}%")
  if info.get("op_tasks"):
    print(f"\n{'task (named scope)':40s} {'per window':>10s} {'share':>6s}")
    for task, us in sorted(by_task.items(), key=lambda kv: -kv[1]):
      print(f"{task:40s} {us / windows / 1e3:8.1f}ms "
            f"{100 * us / total:5.1f}%")
  harness.record("profile_step", {
      "schedule": _SCHEDULE.value, "op_ms_per_window": total / windows / 1e3,
      "ops": ops, "task_ms_per_window": {
          task: us / windows / 1e3 for task, us in by_task.items()}})


if __name__ == "__main__":
  harness.run(main)
