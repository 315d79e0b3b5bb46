"""Stash memory of the executor, from the compiled step's memory analysis.

For every schedule (S=4 identical stages of an MLP wide enough that weights
dominate), compiles the executor's jitted step and reads
`compiled.memory_analysis()`: argument, output, alias and temp bytes per
device. The argument bytes are split by state field (each array's shard on
one device), so the weight ring's bytes can be set against
`max(stash_depth) x stage parameter bytes`. A second sweep widens the ring of
one schedule beyond what it needs (extra, never-used slots) and checks that
only the argument bytes grow with R, not the temps: the ring is indexed in
place, not copied.

  .venv/bin/python experiments/executor_memory.py [--hidden=512] [--layers=4] \
      [--batch=8] [--micro=4] [--out_dir=DIR]
"""

import json

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import numpy as np
import optax

import harness
from stalepipe.pipeline import executor
from stalepipe.models.losses import cross_entropy as classification_loss

S = 4
flags.FLAGS.set_default("layers", 4)
flags.FLAGS.set_default("batch", 8)
flags.FLAGS.set_default("micro", 4)


def analyse(staged, schedule, mesh, batch: int, hidden: int,
            extra_versions: int = 0) -> dict:
  pipe = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                           optax.sgd(0.1), mesh)
  depth = pipe.program.num_versions
  pipe.program = pipe.program._replace(ring_sizes=tuple(
      r + extra_versions for r in pipe.program.ring_sizes))
  state = pipe.init(staged.stage_params)
  x, y = common.make_batch(schedule.num_minibatches,
                           schedule.num_microbatches, 2 * batch, hidden)
  step_fn, state, args = common.step_function(pipe, state, x, y)
  mem = step_fn.memory_analysis()
  fields = {name: common.shard_bytes(getattr(state, name))
            for name in state._fields}
  stage_bytes = max(sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(p))
                    for p in staged.stage_params)
  stream = schedule.with_minibatches(6 * schedule.num_minibatches)
  R = max(stream.stash_depth)
  ring = common.shard_bytes([r.params for r in state.ring])
  return {
      "schedule": schedule.name, "max_stash_depth": R,
      "ring_versions": depth + extra_versions,
      "stage_param_bytes": stage_bytes,
      "ring_bytes": ring, "ring_over_depth_x_stage": ring / (R * stage_bytes),
      "argument_bytes": mem.argument_size_in_bytes,
      "state_field_bytes": fields,
      "argument_bytes_of_inputs_and_tables": common.shard_bytes(args),
      "output_bytes": mem.output_size_in_bytes,
      "alias_bytes": mem.alias_size_in_bytes,
      "temp_bytes": mem.temp_size_in_bytes,
      "temp_over_stage": mem.temp_size_in_bytes / stage_bytes,
  }


def main(argv):
  del argv
  hidden, batch, micro = (common.HIDDEN.value, common.BATCH.value,
                          common.MICRO.value)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  staged = common.make_model(S, hidden, common.LAYERS.value)
  rows = []
  for name in ("gpipe",) + common.ASYNC:
    schedule = common.make_schedule(name, S, micro, 2)
    rows.append(analyse(staged, schedule, mesh, batch, hidden))
    print(json.dumps(rows[-1]))
  sweep = []
  for extra in (0, 2, 4):
    schedule = common.make_schedule("pipedream", S, micro, 2)
    sweep.append(analyse(staged, schedule, mesh, batch, hidden,
                         extra_versions=extra))
    print(json.dumps({k: sweep[-1][k] for k in (
        "ring_versions", "ring_bytes", "argument_bytes", "temp_bytes")}))
  harness.record("executor_memory", {"schedules": rows, "ring_sweep": sweep})


if __name__ == "__main__":
  harness.run(main)
