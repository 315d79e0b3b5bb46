"""A forward-only window: evaluation through the mesh, no backward, no update.

`Pipeline.evaluate` runs the B*M micro-batches of a window through the stages
as a plain forward pipeline (GPipe's fill and drain, forwards only): in tick t
stage s runs the forward of micro-batch t - s on its latest weights, with
`train=False`, and sends its output one hop along 'stage'. The last stage
takes the loss and keeps its output. It reads the state and changes nothing,
whatever schedule trains it: N + S - 1 ticks for N micro-batches, against
the training window's forward, backward and update tasks.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from stalepipe.pipeline import boundary as boundary_lib
from stalepipe.pipeline import packing
from stalepipe.pipeline import stage as stage_lib
from stalepipe.pipeline import tick as tick_lib
from stalepipe.pipeline.state import PipelineState, local

DATA, STAGE = tick_lib.DATA, tick_lib.STAGE


class Forward(NamedTuple):
  """What a forward-only window knows statically."""

  fns: tuple[Callable, ...]  # the stages bound with train=False
  loss_fn: Callable  # loss_fn(y, target) -> scalar mean (no auxiliary terms)
  params: packing.Packing  # the stages' weight layouts
  boundaries: boundary_lib.Boundaries
  output: Any  # the last stage's output, ShapeDtypeStruct pytree
  wants_key: tuple[bool, ...]
  seed: int
  num_microbatches: int  # M


def run(ctx: Forward, state: PipelineState, inputs, targets):
  """The shard_map body: the window's forwards on this device.

  Returns:
    The mean loss over the window's micro-batches (the replicas' mean) and
    the last stage's outputs `[N, b, ...]` (N = B*M), the same on every
    stage.
  """
  S, M = len(ctx.fns), ctx.num_microbatches
  N = jax.tree.leaves(inputs)[0].shape[0] * M
  stage, replica = jax.lax.axis_index(STAGE), jax.lax.axis_index(DATA)
  ring = local(state.ring)
  weights = tick_lib.read_version(ring, 0)
  empty = jax.tree.map(lambda o: jnp.zeros((N,) + o.shape, o.dtype),
                       ctx.output)

  def branch(s):
    def fn(received, item):
      p, m = item // M, item % M
      x = (tick_lib.window_item(inputs, p, m) if s == 0
           else ctx.boundaries.unpack_input(s, received))
      x = stage_lib.with_key(x, ctx.wants_key[s], ctx.seed, p, m, s, replica)
      y = ctx.fns[s](ctx.params.unpack(s, weights), x)
      if s < S - 1:
        return (ctx.boundaries.pack_input(s + 1, y), jnp.zeros((), jnp.float32),
                jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype),
                             ctx.output))
      loss = ctx.loss_fn(y[0], tick_lib.window_item(targets, p, m))
      return (tick_lib.zero_row(ctx.boundaries.acts.lengths),
              jnp.asarray(loss, jnp.float32), y[0])
    return fn

  def one_tick(carry, t):
    received, loss_sum, outputs = carry
    item = t - stage
    valid = (item >= 0) & (item < N)
    send, loss, out = jax.lax.switch(
        stage, [branch(s) for s in range(S)], received,
        jnp.clip(item, 0, N - 1))
    loss_sum = loss_sum + jnp.where(valid, loss, 0.0)
    outputs = jax.tree.map(
        lambda buf, o: jnp.where(valid & (stage == S - 1),
                                 buf.at[jnp.clip(item, 0, N - 1)].set(o), buf),
        outputs, out)
    received = jax.lax.ppermute(send, STAGE,
                                [(s, s + 1) for s in range(S - 1)])
    return (received, loss_sum, outputs), None

  start = (tick_lib.zero_row(ctx.boundaries.acts.lengths),
           jnp.zeros((), jnp.float32), empty)
  (_, loss_sum, outputs), _ = jax.lax.scan(one_tick, start,
                                           jnp.arange(N + S - 1))
  loss = jax.lax.pmean(jax.lax.psum(loss_sum, STAGE), DATA) / N
  outputs = jax.tree.map(lambda o: jax.lax.psum(o, STAGE), outputs)
  return loss, outputs
