"""One command for the executor's GPU figures: idle tick and zb-h1 step.

XLA:GPU may sync with the host for each conditional inside a loop (jax
issues 5986 and 2491), which would make every tick of the executor's
`lax.scan` (a `lax.switch` per stage and kind) cost a host round trip. On one
GPU (mesh 1 x 1, one stage; the tick machinery is the same at any S) this
times, for each tick lowering (`stalepipe.pipeline.dispatch.LOWERINGS`) and
each XLA flag set below, in a fresh process per flag set (XLA_FLAGS is read
at start-up):

- the idle tick: a window whose every task is made idle, over its ticks;
- a zb-h1 window (remat="residuals") and a 1f1b window, per minibatch;
- interleaved 1F1B of 16 blocks cut into v = 2 and 16 chunks on the one
  device, with the slots' and the lanes' tick (`Pipeline(tick=)`), per
  minibatch: whether one conditional a lane beats one a slot there.

Flag sets: none; XLA:GPU command buffers including conditionals and while
loops (so a whole loop can be one CUDA graph). A tick above about 50 us
points at a host round trip per conditional; compare the lowerings and flag
sets to find the mitigation.

  python3 experiments/gpu_check.py [--repeats=20] [--out_dir=DIR]

Runs on any backend (on CPU it only checks that it runs).
"""

import json
import os
import subprocess
import sys
import time

from absl import flags

import harness

_HIDDEN = flags.DEFINE_integer("hidden", 1024, "Width of the MLP.")
_BATCH = flags.DEFINE_integer("batch", 64, "Examples per micro-batch.")
_MICRO = flags.DEFINE_integer("micro", 8, "Micro-batches per minibatch.")
_CHILD = flags.DEFINE_bool("child", False, "Internal: measure in this "
                           "process and print the JSON.")
flags.FLAGS.set_default("repeats", 20)

FLAG_SETS = {
    "default": "",
    "command buffers with conditionals": (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL,"
        "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1"),
}


def measure(hidden: int, batch: int, micro: int, repeats: int) -> dict:
  """Times every lowering in this process (its XLA_FLAGS already set)."""
  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  import jax
  import numpy as np
  import optax
  import stalepipe as sp
  from stalepipe.models.losses import cross_entropy
  from stalepipe.pipeline import dispatch
  from stalepipe.pipeline import executor
  from stalepipe.pipeline import program as program_lib

  mesh = jax.make_mesh((1, 1), ("data", "stage"), devices=jax.devices()[:1])
  staged = sp.models.split(sp.models.mlp(hidden, hidden, 3, hidden), 1)
  B = 2
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, micro, batch, hidden)).astype(np.float32)
  y = rng.integers(0, hidden, size=(B, micro, batch)).astype(np.int32)
  out = {"device": str(jax.devices()[0].device_kind), "runs": {}}
  for lowering in dispatch.LOWERINGS:
    for name in ("zb-h1", "1f1b"):
      schedule = sp.schedules.make(name, num_stages=1, num_microbatches=micro,
                                   num_minibatches=B)
      pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                               optax.sgd(0.01), mesh, lowering=lowering,
                               remat="residuals")
      state = pipe.init(staged.stage_params)
      state, _ = pipe.step(state, x, y)
      step_fn = pipe.compile(state, x, y)
      state, *args = pipe.arguments(state, x, y)
      idle = pipe.program.tables._replace(
          kind=np.full_like(pipe.program.tables.kind, program_lib.IDLE),
          update=np.zeros_like(pipe.program.tables.update))
      idle = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                          idle, args[2])
      times = {"step": [], "idle": []}
      for _ in range(repeats + 2):
        for key, call in (("step", args),
                          ("idle", (args[0], args[1], idle, args[3]))):
          start = time.perf_counter()
          state, metrics = step_fn(state, *call)
          jax.block_until_ready(metrics)
          times[key].append(time.perf_counter() - start)
      ticks = int(pipe.program.tables.kind.shape[1])
      med = {k: float(np.median(v[2:])) for k, v in times.items()}
      out["runs"][f"{name}, {lowering}"] = {
          "ticks": ticks, "step_ms_per_minibatch": 1e3 * med["step"] / B,
          "idle_tick_us": 1e6 * med["idle"] / ticks}
  out["ticks"] = measure_ticks(mesh, x, y, hidden, repeats)
  return out


def measure_ticks(mesh, x, y, hidden: int, repeats: int) -> dict:
  """Interleaved 1F1B on one device, v chunks, each tick: ms a minibatch."""
  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import jax
  import numpy as np
  import optax
  import stalepipe as sp
  from stalepipe.models.losses import cross_entropy
  from stalepipe.pipeline import executor

  B, M = x.shape[:2]
  out = {}
  for v in (2, 16):
    staged = sp.models.split(sp.models.mlp(hidden, hidden, 15, hidden), v)
    schedule = sp.schedules.make("interleaved-1f1b", num_stages=v,
                                 num_microbatches=M, num_minibatches=B,
                                 num_devices=1)
    for tick in ("slots", "lanes"):
      pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                               optax.sgd(0.01), mesh, remat="residuals",
                               tick=tick)
      state = pipe.init(staged.stage_params)
      step_fn = pipe.compile(state, x, y)
      state, *args = pipe.arguments(state, x, y)
      times = []
      for _ in range(repeats + 2):
        start = time.perf_counter()
        state, metrics = step_fn(state, *args)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
      out[f"interleaved-1f1b, v={v}, {tick}"] = {
          "step_ms_per_minibatch": 1e3 * float(np.median(times[2:])) / B}
  return out


def main(argv):
  del argv
  sizes = {"hidden": _HIDDEN.value, "batch": _BATCH.value,
           "micro": _MICRO.value, "repeats": harness.REPEATS.value}
  if _CHILD.value:
    print(json.dumps(measure(**sizes)))
    return
  results = {}
  for label, xla_flags in FLAG_SETS.items():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                      + xla_flags).strip())
    done = subprocess.run(
        [sys.executable, __file__, "--child"]
        + [f"--{name}={value}" for name, value in sizes.items()],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode:
      results[label] = {"error": done.stderr.strip().splitlines()[-1:]}
      print(f"{label}: failed: {results[label]['error']}")
      continue
    results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    for run, r in results[label]["runs"].items():
      print(f"{label:36s} {run:28s} idle tick {r['idle_tick_us']:8.1f} us  "
            f"step {r['step_ms_per_minibatch']:8.3f} ms/minibatch")
    for run, r in results[label]["ticks"].items():
      print(f"{label:36s} {run:34s} step "
            f"{r['step_ms_per_minibatch']:8.3f} ms/minibatch")
  harness.record("gpu_check", results)


if __name__ == "__main__":
  harness.run(main)
