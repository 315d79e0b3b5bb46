"""Shared set-up of the executor benchmarks (`executor_*.py`).

Importing it first gives 8 emulated CPU devices and the model's flags
(`--hidden`, `--layers`, `--batch`, `--micro`; a benchmark with other defaults
sets them with `flags.FLAGS.set_default`). The model is the one every
benchmark uses: `stalepipe.models.mlp` of width H with `layers` blocks per
stage, so that all S stages are identical `H x H` stages (which the stacked
MaxText-style baseline needs).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

import harness  # pylint: disable=g-import-not-at-top,wrong-import-position
import stalepipe as sp  # pylint: disable=g-import-not-at-top,wrong-import-position
from stalepipe.pipeline import program as program_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from stalepipe.schedules import kinds  # pylint: disable=g-import-not-at-top,wrong-import-position

HIDDEN = flags.DEFINE_integer("hidden", 512, "Width H of every block.")
LAYERS = flags.DEFINE_integer("layers", 2, "Blocks per stage.")
BATCH = flags.DEFINE_integer("batch", 32, "Examples per replica.")
MICRO = flags.DEFINE_integer("micro", 8, "Micro-batches per minibatch.")

ASYNC = ("1f1b", "pipedream", "2bw", "hetpipe", "timeprest")
_OPTIONS = {"hetpipe": {"concurrent_minibatches": 2}}


def make_schedule(name: str, stages: int, micro: int, minibatches: int,
                  devices: int = 1):
  """`name` over `stages` stages; a device-level loop schedule
  (interleaved-1f1b, looped-bfs) on `devices` devices, S / devices chunks
  each (one device: every stage a chunk of it, one task a tick)."""
  options = dict(_OPTIONS.get(name, {}))
  if sp.schedules.takes_num_devices(name):
    options["num_devices"] = devices
  return sp.schedules.make(name, num_stages=stages, num_microbatches=micro,
                           num_minibatches=minibatches, **options)


def make_model(stages: int, hidden: int, layers: int, seed: int = 0):
  """`stages` identical stages of `layers` blocks `hidden -> hidden`."""
  blocks = sp.models.mlp(hidden, hidden, stages * layers - 1, hidden,
                         seed=seed)
  return sp.models.split(blocks, stages)


def make_batch(minibatches: int, micro: int, examples: int, hidden: int,
               seed: int = 0):
  """Inputs `[B, M, N, H]` and integer labels `[B, M, N]` in `[0, H)`."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(minibatches, micro, examples, hidden))
  y = rng.integers(0, hidden, size=(minibatches, micro, examples))
  return x.astype(np.float32), y.astype(np.int32)


def shard_bytes(tree) -> int:
  """Bytes of one device's shard of every array in `tree`."""
  return sum(int(a.addressable_shards[0].data.nbytes)
             for a in jax.tree.leaves(tree))


def step_function(pipe, state, inputs, targets):
  """The executor's compiled window step, and the arguments it takes.

  Runs one window through `pipe.step` first. Returns `(step_fn, state,
  args)`: `step_fn(state, *args)` runs one more window (the state is donated:
  use the one it returns).
  """
  state, _ = pipe.step(state, inputs, targets)
  step_fn = pipe.compile(state, inputs, targets)
  state, *args = pipe.arguments(state, inputs, targets)
  return step_fn, state, tuple(args)


def window_runner(pipe, stage_params, inputs, targets):
  """`pipe`'s compiled window from a fresh state (`step_function`), as a
  callable that runs one more window and waits for it; returns it, the box
  holding the state it advances, and the compiled step."""
  step_fn, state, args = step_function(pipe, pipe.init(stage_params), inputs,
                                       targets)
  box = [state]

  def run():
    box[0], metrics = step_fn(box[0], *args)
    jax.block_until_ready(metrics)

  return run, box, step_fn


def baseline_run(staged, mesh, inputs_MxNx, targets_MxN):
  """A callable running one step of the MaxText-style GPipe baseline."""
  import baseline_gpipe  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import optax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from stalepipe.models.losses import cross_entropy  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  base = baseline_gpipe.GPipeBaseline(baseline_gpipe.mlp_stage, cross_entropy,
                                      optax.sgd(0.01), mesh)
  state = list(base.init(staged.stage_params))
  xs, ys = base.put_batch(inputs_MxNx, targets_MxN)

  def run():
    state[0], state[1], loss = base.step(*state, xs, ys)
    jax.block_until_ready(loss)

  return run


def interleaved_samples(runs: dict) -> dict:
  """Seconds of each run, `harness.interleave`d over `--repeats` rounds,
  after a warm-up of two calls each (compile and first touch)."""
  for run in runs.values():
    run()
  return harness.interleave(runs)


def config(*names: str) -> dict:
  """The values of the flags `names`, for a result's "config"."""
  return {name: flags.FLAGS[name].value for name in names}


def with_tables(args: tuple, tables) -> tuple:
  """`args` of `step_function` with other instruction tables, placed alike."""
  inputs, targets, placed, plan = args
  tables = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                        tables, placed)
  return inputs, targets, tables, plan


def cut_table(program: program_lib.Program,
              keep: tuple[str, ...]) -> program_lib.Instructions:
  """The program's tables with every task whose kind is not in `keep` made
  idle. Receives whose sender went idle and updates whose backwards went are
  dropped too.
  """
  tables = program.tables
  codes = [program.kind_code(k) for k in keep if k in program.kinds]
  cut = {"kind": np.where(np.isin(tables.kind, codes), tables.kind,
                          program_lib.IDLE)}
  if not any(kinds.kind(k).runs_forward for k in keep):
    cut["recv_forward"] = np.full_like(tables.recv_forward, -1)
  if not any(kinds.kind(k).runs_backward for k in keep):
    cut["recv_backward"] = np.full_like(tables.recv_backward, -1)
    cut["update"] = np.zeros_like(tables.update)
  return tables._replace(**cut)
