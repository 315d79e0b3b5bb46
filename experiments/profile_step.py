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
      [--schedule zb-h1] [--remat residuals] [--layout packed] [--batch 32] \
      [--top 15]
  PYTHONPATH=. .venv/bin/python experiments/profile_step.py --schedule baseline
"""

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import executor_common as common  # pylint: disable=g-bad-import-order

import jax
import numpy as np

from stalepipe.pipeline import packing

import zero_bubble

# Trace events that contain ops or wait for others, not ops themselves.
_CONTAINERS = re.compile(
    r"^(ThunkExecutor|Wait|conditional|while|Rendezvous|\$|end:|"
    r"InvokeRendezvous|SlinkyThreadPool|call|Thunk|PjitFunction|"
    r"CommonPjRt|ppermute|psum|all-reduce)")


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--schedule", default="zb-h1",
                      help="a schedule name, or 'baseline'")
  parser.add_argument("--remat", default="residuals",
                      choices=zero_bubble.REMATS)
  parser.add_argument("--layout", default="packed",
                      choices=tuple(packing.LAYOUTS))
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--layers", type=int, default=2, help="per stage")
  parser.add_argument("--batch", type=int, default=32, help="per replica")
  parser.add_argument("--micro", type=int, default=8)
  parser.add_argument("--minibatches", type=int, default=2)
  parser.add_argument("--windows", type=int, default=3, help="traced")
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args()
  if args.windows < 1 or args.top < 1:
    parser.error(f"--windows {args.windows} and --top {args.top}: "
                 "each must be at least 1")
  mesh = jax.make_mesh((2, zero_bubble.S), ("data", "stage"))
  staged = common.make_model(zero_bubble.S, args.hidden, args.layers)
  x, y = common.make_batch(args.minibatches, args.micro, 2 * args.batch,
                           args.hidden)
  info = {}
  if args.schedule == "baseline":
    run = common.baseline_run(staged, mesh, x[0], y[0])
  else:
    run, _, info = zero_bubble.build(args.schedule, args.remat,
                                     "nested_switch", staged, mesh, x, y,
                                     layout=args.layout, with_ops=True)
  for _ in range(3):
    run()
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(args.windows):
      run()
    jax.profiler.stop_trace()
    durations, by_task = op_durations(trace_dir, info.get("op_tasks"))
  total = sum(sum(v) for v in durations.values())
  print(f"{args.schedule}: op time {total / args.windows / 1e3:.1f} ms per "
        "window, summed over device threads")
  print(f"{'op':40s} {'calls':>6s} {'median':>8s} {'mean':>8s} {'p90':>8s} "
        f"{'share':>6s}")
  ranked = sorted(durations.items(), key=lambda kv: -sum(kv[1]))
  for name, values in ranked[:args.top]:
    v = np.asarray(values)
    print(f"{name[:40]:40s} {len(v) // args.windows:6d} "
          f"{np.median(v):6.0f}us {v.mean():6.0f}us "
          f"{np.percentile(v, 90):6.0f}us {100 * v.sum() / total:5.1f}%")
  if info.get("op_tasks"):
    print(f"\n{'task (named scope)':40s} {'per window':>10s} {'share':>6s}")
    for task, us in sorted(by_task.items(), key=lambda kv: -kv[1]):
      print(f"{task:40s} {us / args.windows / 1e3:8.1f}ms "
            f"{100 * us / total:5.1f}%")


if __name__ == "__main__":
  main()
