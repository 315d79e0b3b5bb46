"""What a pipeline carries between windows and between ticks, as typed trees.

Every leaf of `PipelineState` holds all replicas and stages: `[D, S, ...]`
for what lives with one stage of one replica, sharded over ('data',
'stage'); row r of the S holds stage `placement.order[r]`. Inside the
shard_map program each device sees its own `[1, F, ...]` block (F stages a
device), which `local` cuts into the per-stage views the tick functions
work on.
"""

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from stalepipe.pipeline import packing


class WeightRing(NamedTuple):
  """A stage's weight versions (its stash), in a ring of R slots."""

  params: packing.Flat  # dtype -> [D, S, R, L]: one packed version a slot
  versions: jax.Array  # int32 [D, S, R]: the version in each slot; -1 empty
  latest: jax.Array  # int32 [D, S]: updates the stage has applied


class Buffers(NamedTuple):
  """Per stage, C slots of micro-batches between their tasks, and a scratch
  slot (index C) that ticks with nothing to file write instead."""

  acts: packing.Flat  # dtype -> [D, S, C+1, A]: a stage's inputs (a
  #   micro-batch's pytree, each leaf in its own dtype: `boundary.py`),
  #   kept for backward
  cots: packing.Flat  # dtype -> [D, S, C+1, A']: its output cotangents (the
  #   inexact leaves), until used
  residuals: packing.Flat  # dtype -> [D, S, C+1, L_res]: the forward's
  #   residuals (`residuals.py`); empty with remat="recompute"
  op_cotangents: packing.Flat  # dtype -> [D, S, C+1, L_cot]: each weight
  #   op's output cotangent, from BI for BW (`split_backward.py`); empty
  #   unless the backward is split


class InputHistory(NamedTuple):
  """Earlier windows' inputs that tasks of this window still read (None
  where no task does, H = 0: no zero-size arrays in a checkpoint)."""

  inputs: Any  # pytree of [H*B, M, D*b, ...], or None
  targets: Any  # pytree of [H*B, M, D*b, ...], or None


class PipelineState(NamedTuple):
  """Everything a pipeline carries between windows."""

  ring: WeightRing
  opt_state: packing.Flat  # dtype -> [D, S, L_opt]: packed optimizer states
  grads: packing.Flat  # dtype -> [D, S, L]: the minibatch being accumulated
  buffers: Buffers | None  # None until the first step fixes the shapes
  history: InputHistory | None  # None until the first step
  sync: Any  # the sync policy's state (`SyncPolicy.init_state`), [D, S, ...]
  step: jax.Array  # int32 []: windows run so far
  stage_state: packing.Flat | None = None  # dtype -> [D, S, L_state]: the
  #   stages' non-parameter states (`stage.py`), packed; None: no stage has one


class TickCarry(NamedTuple):
  """One device's view inside the tick loop: its stage on its replica."""

  ring: WeightRing  # params dtype -> [R, L], versions [R], latest []
  opt_state: packing.Flat  # dtype -> [L_opt]
  grads: packing.Flat  # dtype -> [L]
  grads_spent: jax.Array  # bool []: an update consumed `grads`, which now
  #   reads as zero (`tick.accumulated`) until the next gradient overwrites it
  buffers: Buffers  # dtype -> [C+1, A] each
  sync: Any  # the policy's state for this stage and replica
  loss_sum: jax.Array  # float32 []: losses of micro-batches ended here
  num_losses: jax.Array  # int32 []
  metric_sums: dict  # name -> float32 []: their metrics (`stage.Output`)
  stage_state: packing.Flat | None  # dtype -> [L_state]: this stage's state
  arrivals: Any = None  # `tick.Arrivals`: what arrived last tick, to file


def local(tree, slot: int = 0):
  """The view of local slot `slot` in a device's `[1, F, ...]` blocks (F
  stages a device, `placement.py`)."""
  return jax.tree.map(lambda v: v[0, slot], tree)


def unlocal(trees: Sequence[Any]):
  """The inverse of `local`: the F slots' views as `[1, F, ...]` blocks."""
  return jax.tree.map(lambda *v: jnp.stack(v)[None], *trees)
