"""A forward-only window: evaluation through the mesh, no backward, no update.

`Pipeline.evaluate` runs the B*M micro-batches of a window through the stages
as a plain forward pipeline (GPipe's fill and drain, forwards only): in tick t
stage s runs the forward of micro-batch t - s on its latest weights, with
`train=False`, and sends its output one hop along 'stage'. The last stage
takes the loss (and the stages' metrics) and keeps its output. Stages with a
non-parameter state read it (BatchNorm's running statistics). It reads the
state and changes nothing,
whatever schedule trains it: N + S - 1 ticks for N micro-batches, against
the training window's forward, backward and update tasks.
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from stalepipe.pipeline import boundary as boundary_lib
from stalepipe.pipeline import fsdp
from stalepipe.pipeline import packing
from stalepipe.pipeline import placement as placement_lib
from stalepipe.pipeline import pool as pool_lib
from stalepipe.pipeline import stage as stage_lib
from stalepipe.pipeline import tick as tick_lib
from stalepipe.pipeline.state import PipelineState, local

DATA, STAGE = tick_lib.DATA, tick_lib.STAGE


class Forward(NamedTuple):
  """What a forward-only window knows statically."""

  fns: tuple[Callable, ...]  # the stages bound with train=False
  loss_fn: Callable  # loss_fn(y, target) -> scalar mean, or (it, metrics)
  params: packing.Packing  # the stages' weight layouts
  boundaries: boundary_lib.Boundaries
  output: Any  # the last stage's output, ShapeDtypeStruct pytree
  wants: tuple[frozenset, ...]  # per stage, its keyword arguments
  states: packing.Packing | None  # the stages' state layouts
  objective: Any  # `stage.evaluation_objective`'s shapes: (loss, metrics)
  seed: int
  num_microbatches: int  # M
  placement: placement_lib.Placement  # the stages each device holds
  sharded: Any = None  # `fsdp.Sharded`: each stage cut over 'fsdp'; None

  @property
  def lead(self) -> int:
    return fsdp.lead(self.sharded)

  @property
  def batch_axes(self):
    return fsdp.batch_axes(self.sharded, DATA)


def _zero_objective(ctx: Forward):
  """Float32 zeros shaped like `(loss, metrics)`."""
  return jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32),
                      ctx.objective)


def _forward(ctx: Forward, s: int, inputs, targets, weights, states, replica,
             received, item):
  """Stage s's forward of window micro-batch `item`: what it sends on, its
  `(loss, metrics)` (zeros but on the last stage) and its output (the last
  stage's; zeros elsewhere)."""
  M, last = ctx.num_microbatches, s == len(ctx.fns) - 1
  p, m = item // M, item % M
  x = (tick_lib.window_item(inputs, p, m) if s == 0
       else ctx.boundaries.unpack_input(s, received))
  x = stage_lib.with_extras(
      x, ctx.wants[s], ctx.seed, p, m, s, replica,
      None if "state" not in ctx.wants[s] else ctx.states.unpack(s, states))
  if ctx.sharded is None:
    weights = ctx.params.unpack(s, weights)
  else:  # the members' parts, gathered before the branch
    weights = ctx.sharded.params.merge_packed(s, ctx.params, weights)
  y = ctx.fns[s](weights, x)
  zeros = _zero_objective(ctx)
  if not last:
    return (ctx.boundaries.pack_input(s + 1, y), zeros,
            jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), ctx.output))
  loss = stage_lib.evaluation_objective(ctx.loss_fn, y,
                                        tick_lib.window_item(targets, p, m))
  return (tick_lib.zero_row(ctx.boundaries.acts.lengths),
          jax.tree.map(lambda v, z: jnp.asarray(v, z.dtype), loss, zeros),
          y[0])


def _slot(ctx: Forward, state: PipelineState, inputs, targets, replica,
          device, j: int):
  """Slot j of this device: its stage and the forward of each stage a
  device may hold there (`placement.py`), on its latest weights."""
  candidates = ctx.placement.stages[:, j]
  ring = local(state.ring, min(j, len(state.ring) - 1), ctx.lead)
  if isinstance(ring, pool_lib.StashPool):  # slot j's rows of the pool
    ring = pool_lib.views(ring)[j]
  weights = tick_lib.read_version(ring, 0)
  if ctx.sharded is not None:
    weights = fsdp.gather(weights)
  branches = [functools.partial(_forward, ctx, int(s), inputs, targets,
                                weights, local(state.stage_state, j, ctx.lead),
                                replica)
              for s in candidates]
  return jnp.asarray(candidates)[device], branches


def run(ctx: Forward, state: PipelineState, inputs, targets):
  """The shard_map body: the window's forwards on this device.

  Returns:
    The mean loss (`loss`) and the mean of every metric over the window's
    micro-batches (the replicas' mean), and the last stage's outputs `[N, b,
    ...]` (N = B*M), the same on every stage.
  """
  S, M = len(ctx.fns), ctx.num_microbatches
  N = jax.tree.leaves(inputs)[0].shape[0] * M
  device, replica = jax.lax.axis_index(STAGE), jax.lax.axis_index(DATA)
  slots = [_slot(ctx, state, inputs, targets, replica, device, j)
           for j in range(ctx.placement.num_slots)]
  empty = jax.tree.map(lambda o: jnp.zeros((N,) + o.shape, o.dtype),
                       ctx.output)
  nothing = tick_lib.zero_row(ctx.boundaries.acts.lengths)

  def one_tick(carry, t):
    received, loss_sum, outputs = carry
    sends = []
    for (stage, branches), got in zip(slots, received):
      item = t - stage
      valid = (item >= 0) & (item < N)
      send, loss, out = jax.lax.switch(device, branches, got,
                                       jnp.clip(item, 0, N - 1))
      loss_sum = jax.tree.map(lambda a, v: a + jnp.where(valid, v, 0.0),
                              loss_sum, loss)
      outputs = jax.tree.map(
          lambda buf, o, item=item, keep=valid & (stage == S - 1): jnp.where(
              keep, buf.at[jnp.clip(item, 0, N - 1)].set(o), buf),
          outputs, out)
      sends.append(send)
    received = [nothing] * len(slots)
    for h in ctx.placement.hops(1):
      received[h.dest] = tick_lib.hop(ctx.placement, sends[h.source], h,
                                      device, received[h.dest])
    return (received, loss_sum, outputs), None

  start = ([nothing] * len(slots), _zero_objective(ctx), empty)
  (_, loss_sum, outputs), _ = jax.lax.scan(one_tick, start,
                                           jnp.arange(N + S - 1))
  loss, metrics = jax.tree.map(
      lambda v: jax.lax.pmean(jax.lax.psum(v, STAGE), ctx.batch_axes) / N,
      loss_sum)
  # The last stage's outputs to every stage (the others hold zeros), each
  # leaf in its own dtype (a psum of bools would give int32).
  outputs = jax.tree.map(lambda o: jax.lax.psum(o, STAGE).astype(o.dtype),
                         outputs)
  return {"loss": loss, **metrics}, outputs
