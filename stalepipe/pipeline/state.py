"""What a pipeline carries between windows and between ticks, as typed trees.

What lives with one stage of one replica is held slot by slot: each such
field of `PipelineState` is a tuple of F trees (F stages a device, in its
local slots, `placement.py`), slot j's leaves `[D, P, ...]` sharded over
('data', 'stage'), holding on device d the stage `placement.stages[d, j]`.
A stage sharded over 'fsdp' (`fsdp.py`) adds a member axis: `[D, P, F, ...]`,
sharded over ('data', 'stage', 'fsdp'), member i holding its part.
Inside the shard_map program each device sees its own `[1, 1, ...]` block of
each slot, which `local` reads as the per-stage view the tick functions work
on without moving a byte: a folded device's rings and buffers are not cut
out of one array and stacked back every window.
"""

from typing import Any, NamedTuple, Sequence

import jax

from stalepipe.pipeline import packing


class WeightRing(NamedTuple):
  """A stage's weight versions (its stash), in a ring of R slots."""

  params: packing.Flat  # dtype -> [D, P, R, L]: one packed version a slot
  versions: jax.Array  # int32 [D, P, R]: the version in each slot; -1 empty
  latest: jax.Array  # int32 [D, P]: updates the stage has applied


class Buffers(NamedTuple):
  """Per stage, C slots of micro-batches between their tasks, and a scratch
  slot (index C) that ticks with nothing to file write instead."""

  acts: packing.Flat  # dtype -> [D, P, C+1, A]: a stage's inputs (a
  #   micro-batch's pytree, each leaf in its own dtype: `boundary.py`),
  #   kept for backward
  cots: packing.Flat  # dtype -> [D, P, C+1, A']: its output cotangents (the
  #   inexact leaves), until used
  residuals: packing.Flat  # dtype -> [D, P, C+1, L_res]: the forward's
  #   residuals (`residuals.py`); empty with remat="recompute"
  op_cotangents: packing.Flat  # dtype -> [D, P, C+1, L_cot]: each weight
  #   op's output cotangent, from BI for BW (`split_backward.py`); empty
  #   unless the backward is split


class InputHistory(NamedTuple):
  """Earlier windows' inputs that tasks of this window still read (None
  where no task does, H = 0: no zero-size arrays in a checkpoint)."""

  inputs: Any  # pytree of [H*B, M, D*b, ...], or None
  targets: Any  # pytree of [H*B, M, D*b, ...], or None


class PipelineState(NamedTuple):
  """Everything a pipeline carries between windows; the per-stage fields
  are tuples over a device's F local slots (the module docstring)."""

  ring: tuple[WeightRing, ...]
  opt_state: tuple[packing.Flat, ...]  # dtype -> [D, P, L_opt]: packed
  #   optimizer states
  grads: tuple[packing.Flat, ...]  # dtype -> [D, P, L]: the minibatch being
  #   accumulated
  buffers: tuple[Buffers, ...] | None  # None until the first step fixes the
  #   shapes
  history: InputHistory | None  # None until the first step
  sync: tuple[Any, ...]  # the sync policy's state (`SyncPolicy.init_state`),
  #   [D, P, ...]
  step: jax.Array  # int32 []: windows run so far
  stage_state: tuple[packing.Flat, ...] | None = None  # dtype -> [D, P,
  #   L_state]: the stages' non-parameter states (`stage.py`), packed; None:
  #   no stage has one
  drained: jax.Array | None = None  # bool []: True once `Pipeline.drain`
  #   ran (such a state takes no further step); None before


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
  outbox: Any = None  # `tick.Outbox`: what its task sent in its last tick


def local(slots: Sequence[Any] | None, slot: int = 0, lead: int = 2):
  """Local slot `slot`'s view of a per-stage field on this device: its
  `[1, 1, ...]` blocks without their `lead` leading axes (3 where a stage
  is sharded over 'fsdp': `[D, P, F, ...]`, `fsdp.py`; None stays None)."""
  if slots is None:
    return None
  return jax.tree.map(lambda v: v[(0,) * lead], slots[slot])


def unlocal(trees: Sequence[Any], lead: int = 2) -> tuple[Any, ...] | None:
  """The inverse of `local`: the slots' views as `[1, 1, ...]` blocks."""
  if all(tree is None for tree in trees):
    return None
  return tuple(jax.tree.map(lambda v: v[(None,) * lead], tree)
               for tree in trees)
