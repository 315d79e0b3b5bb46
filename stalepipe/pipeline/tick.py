"""One tick of the shard_map executor, as pure functions a reader can follow.

In order, as `tick` runs them on every device (each of its slots' stages):

1. `receive`: what the neighbours sent last tick (their `Outbox`) moves one
   hop along 'stage' (`ppermute`, or within the device) and the receiver
   files it in the buffer slots its row of last tick names.
2. `run_task`: the task the stage's row of the instruction tables names. It
   reads the weights the task needs (`task_weights`: the version the
   schedule's version map names, as the update rule predicts it) and the
   micro-batch's input (`stage_input`), and runs what the task's kind
   declares (`stalepipe.schedules.kinds`): the forward, the backward, or
   both; it returns what it sends on and what it keeps (`TaskOutput`).
   `keep_residuals` writes what it keeps (F: its residuals; a split
   backward's BI: the weight ops' output cotangents) into its slot, and
   what it sends goes into the stage's outbox.
3. `apply_update`: at the end of the tick in which a stage's last
   weight-gradient task of a minibatch ends, the sync policy reduces the
   gradient, the optimizer steps, the policy acts on the new weights, and
   they are written into the ring as the next version.

`Stages` holds what these functions know statically (stage functions,
layouts, the optimizer and the sync policy); `Window` holds the values that
are fixed for a window (its inputs, plan, and where this device sits).
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stalepipe import sync as sync_lib
from stalepipe.pipeline import boundary as boundary_lib
from stalepipe.pipeline import contract
from stalepipe.pipeline import fsdp
from stalepipe.pipeline import packing
from stalepipe.pipeline import placement as placement_lib
from stalepipe.pipeline import pool as pool_lib
from stalepipe.pipeline import program as program_lib
from stalepipe.pipeline import residuals as residuals_lib
from stalepipe.pipeline import scope as scope_lib
from stalepipe.pipeline import split_backward as split_lib
from stalepipe.pipeline import stage as stage_lib
from stalepipe.pipeline.state import Buffers, TickCarry, WeightRing
from stalepipe.schedules import kinds as kinds_lib

DATA, STAGE = "data", "stage"


class Stages(NamedTuple):
  """What the tick functions know statically about a pipeline."""

  fns: tuple[Callable, ...]  # S stage functions as bound (`stage.bind`):
  #   f_s(params_s, x) -> y, or f_s(params_s, (x, extras)) -> y
  state_fns: tuple[Callable | None, ...]  # per stage, its new state from a
  #   training forward (`stage.bind_state`); None for stages without state
  loss_fn: Callable  # (y, target) -> (scalar mean, metrics) (`bind_loss`)
  params: packing.Packing  # the stages' weight layouts
  opt: packing.Packing  # the stages' optimizer-state layouts
  optimizer: Any  # optax transformation, maybe with `predict`
  sync: sync_lib.SyncPolicy
  program: program_lib.Program
  boundaries: boundary_lib.Boundaries  # each stage's input and how its
  #   leaves (and their cotangents) sit in buffer rows, per dtype
  num_microbatches: int  # M
  window_minibatches: int  # B
  lowering: Callable  # `dispatch.LOWERINGS` entry
  residuals: residuals_lib.Layout | None  # remat="residuals"; None: recompute
  forwards: tuple[Callable, ...]  # per stage, (p, x, target) -> (value,
  #   kept): what F runs with remat="residuals" (`residuals.analyse`)
  split: split_lib.Layout | None  # BI keeps op cotangents for BW; None: the
  #   backward tasks call the whole pullback
  stale_schedule: bool  # `contract.schedule_is_stale`: pass stale_params
  wants: tuple[frozenset, ...]  # per stage: the keyword arguments it takes
  #   (`stage.ARGUMENTS`): a PRNG key, its state
  states: packing.Packing | None  # the stages' state layouts; None: none
  objective: Any  # the last stage's objective, shapes: (loss, metrics)
  seed: int  # the run's seed, whence every task's key (`stage.key_data`)
  whole_model: bool  # `scope.py`: the update rule steps on all stages'
  #   trees together (gathered over 'stage'), else on each stage's own
  placement: placement_lib.Placement  # which stage sits in which slot of
  #   which device on 'stage' (`placement.py`)
  tied: frozenset = frozenset()  # names of parameters several stages hold
  #   (`scope.join`: their gradients summed, one update on every copy)
  sharded: fsdp.Sharded | None = None  # each stage cut over 'fsdp'
  #   (`fsdp.py`); None: a stage on one device
  gather_once: bool = False  # a sharded stage's version gathered once a
  #   window (`fsdp.check_gather`), else once a task
  lanes: Any = None  # int32 [K, T, P, L]: the slot each of a device's L
  #   lanes runs per tick (`lanes.py`); None: every slot, every tick

  @property
  def lead(self) -> int:
    return fsdp.lead(self.sharded)

  @property
  def batch_axes(self):
    return fsdp.batch_axes(self.sharded, DATA)

  @property
  def num_stages(self) -> int:
    return len(self.fns)

  @property
  def predicts(self) -> bool:
    """Whether tasks read the optimizer's predicted weights."""
    return contract.predicts(self.optimizer)


class Window(NamedTuple):
  """Values fixed for one window, on one device."""

  inputs: jax.Array  # [(H+1)B, M, b, ...]: this and earlier windows' inputs
  targets: jax.Array  # [(H+1)B, M, b, ...]
  plan: dict  # the sync policy's plan, rows [(H+1)B, ...]
  base: jax.Array  # int32 []: slot offset of this window's micro-batches
  step: jax.Array  # int32 []: windows run before this one
  stage: jax.Array  # int32 []: the stage of the slot running (`at_slot`)
  replica: jax.Array  # int32 []: this device's data replica
  device: jax.Array  # int32 []: this device's index on 'stage'
  candidates: tuple[int, ...] = ()  # the stage each device holds in the
  #   slot running: what dispatch chooses from, by `device`
  gathered: Any = None  # sharded stage: the slot's version its task reads,
  #   all-gathered over 'fsdp', dtype -> [F, L] (`fsdp.gather`)
  once: tuple = ()  # with `gather_once`: every slot's version, gathered
  #   before the window's first tick
  choice: Any = None  # int32 []: which of `candidates` this device runs
  lane: Any = None  # int32 []: with the lanes' tick (`lanes.py`), the slot
  #   running: whose rows of the device's stacked buffers a task reads and
  #   whose row of the stacked accumulator it adds to; None: the slots' tick


def at_slot(ctx: Stages, window: Window, j: int) -> Window:
  """`window` as slot j of this device sees it: its stage, and the stages
  the devices hold in slot j (one per device), which dispatch picks from."""
  candidates = ctx.placement.stages[:, j]
  return window._replace(stage=jnp.asarray(candidates)[window.device],
                         candidates=tuple(int(s) for s in candidates),
                         choice=window.device)


class TaskOutput(NamedTuple):
  """What a task sends on and keeps this tick (zeros when nothing).

  Buffers are written one row per tick outside the task's branch, into the
  slot the row names or, when there is nothing to write, into a scratch slot
  (index C): a branch that returned a whole buffer would make every other
  branch copy it, every tick.
  """

  forward: packing.Flat  # dtype -> [A]: the output, to stage s+1
  backward: packing.Flat  # dtype -> [W, A']: input cotangents, to stage s-1
  kept: packing.Flat  # dtype -> [L_res]: the forward's residuals (remat)
  kept_slot: jax.Array  # int32 []: their slot; C (scratch) when none
  op_cotangents: packing.Flat  # dtype -> [L_cot]: BI's, for BW (split)
  op_cotangents_slot: jax.Array  # int32 []: their slot; C when none


def accumulated(carry: TickCarry) -> packing.Flat:
  """The minibatch's gradient so far: `carry.grads`, or zeros where an
  update has consumed it (`grads_spent`).

  An update does not zero the accumulator: a branch that wrote a new buffer
  there would make every branch that passes the accumulator through copy it
  (XLA:CPU's conditionals, `dispatch.py`), every tick. The next weight
  gradient overwrites it instead, in the same fused pass as its add.
  """
  return jax.tree.map(
      lambda g: jnp.where(carry.grads_spent, jnp.zeros((), g.dtype), g),
      carry.grads)


def ring_slot(versions: jax.Array, version) -> jax.Array:
  """The ring slot holding `version`."""
  return jnp.argmax(versions == version)


def read_version(ring: WeightRing | pool_lib.PoolView, lag) -> packing.Flat:
  """The packed version `lag` updates behind the latest (a ring of one
  version, a schedule without stashes, reads its only slot in place; a
  slot's view of a pooled stash reads its own rows, `pool.py`)."""
  if isinstance(ring, pool_lib.PoolView):
    at = pool_lib.row(ring, ring.latest - lag)
    return {k: v[at] for k, v in ring.params.items()}
  if ring.versions.shape[0] == 1:
    return {k: v[0] for k, v in ring.params.items()}
  slot = ring_slot(ring.versions, ring.latest - lag)
  return {k: v[slot] for k, v in ring.params.items()}


def merged(ctx: Stages, s: int, gathered: packing.Flat, shards=None,
           layout=None) -> Any:
  """Stage s's whole tree from its members' packed parts gathered over
  'fsdp' (`[F, L]` per dtype): weights by default, or the optimizer
  state's (`shards`, `layout`)."""
  return (shards or ctx.sharded.params).merge_packed(
      s, layout or ctx.params, gathered)


def own_part(ctx: Stages, s: int, tree, shards=None, layout=None
             ) -> packing.Flat:
  """This member's part of stage s's whole tree, packed (`merged`'s
  inverse)."""
  shards = shards or ctx.sharded.params
  layout = layout or ctx.params
  return layout.pack(s, shards.cut(s, tree, fsdp.member()))


def gradient_rows(ctx: Stages, s: int, grads) -> packing.Flat:
  """Stage s's whole gradient as the `[F, L]` rows (member i's part in row
  i) that `fsdp.scatter_mean` reduces."""
  rows = [ctx.params.pack(s, part)
          for part in ctx.sharded.params.parts(s, grads)]
  return {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}


def predicted_part(ctx: Stages, carry: TickCarry, instr, window: Window
                   ) -> packing.Flat:
  """A sharded stage's packed part of the version its task reads, as the
  optimizer's `predict` makes it where it has one (an elementwise
  prediction, `fsdp.check`: on the member's parts, before the gather; the
  per-stage branch holds no collective)."""
  flat = read_version(carry.ring, instr.lag)
  if not ctx.predicts:
    return flat
  counts = {"ahead": instr.ahead, "since_forward": instr.since_forward}
  if contract.pipeline_wide(ctx.optimizer):
    counts["pipeline_ahead"] = instr.pipeline_ahead

  def predict(s, f, opt_state):
    return ctx.params.pack(s, ctx.optimizer.predict(
        ctx.opt.unpack(s, opt_state), ctx.params.unpack(s, f), **counts)), ()

  out, _ = ctx.lowering(
      window.choice, 1, [[lambda f, o: (f, ()),
                          lambda f, o, s=s: predict(s, f, o)]
                         for s in window.candidates], flat, carry.opt_state)
  return out


def task_weights(ctx: Stages, s: int, carry: TickCarry, instr,
                 window: Window | None = None) -> Any:
  """Stage s's weights for a task: the version its row names (on a sharded
  stage, gathered before the task: `window.gathered`), through the
  optimizer's `predict` when it has one (SAPipe, SpecTrain, PipeMare)."""
  if ctx.sharded is not None:
    return merged(ctx, s, window.gathered)
  weights = ctx.params.unpack(s, read_version(carry.ring, instr.lag))
  if not ctx.predicts:
    return weights
  counts = {"ahead": instr.ahead, "since_forward": instr.since_forward}
  if contract.pipeline_wide(ctx.optimizer):
    counts["pipeline_ahead"] = instr.pipeline_ahead
  return ctx.optimizer.predict(ctx.opt.unpack(s, carry.opt_state), weights,
                               **counts)


def read_slot(buffer: packing.Flat, slot) -> packing.Flat:
  """One slot's row of a per-dtype buffer."""
  return {k: v[slot] for k, v in buffer.items()}


def zero_row(lengths: dict, lead: tuple = ()) -> packing.Flat:
  """A per-dtype row of zeros (`lead`: leading axes)."""
  return {k: jnp.zeros(lead + (n,), k) for k, n in lengths.items()}


def window_item(tree, minibatch, microbatch):
  """One micro-batch of a window's inputs or targets (pytrees allowed)."""
  return jax.tree.map(lambda v: v[minibatch, microbatch], tree)


def stage_input(ctx: Stages, s: int, carry: TickCarry, instr, window: Window,
                offset: int = 0):
  """The input of the task's micro-batch `offset` (nF1B: 0..M-1): a pytree,
  each leaf in its own dtype."""
  if s == 0:
    return window_item(window.inputs, instr.minibatch,
                       instr.microbatch + offset)
  return ctx.boundaries.unpack_input(s, read_slot(
      carry.buffers.acts, slot_of(ctx, instr, window, offset)))


def bound_input(ctx: Stages, s: int, carry: TickCarry, instr, window: Window,
                offset: int = 0):
  """What the bound stage function takes (`stage.bind`): the input of the
  task's micro-batch `offset`, with its key where the stage wants one."""
  minibatch = ((window.step - ctx.program.history) * ctx.window_minibatches
               + instr.minibatch)
  return stage_lib.with_extras(
      stage_input(ctx, s, carry, instr, window, offset), ctx.wants[s],
      ctx.seed, minibatch, instr.microbatch + offset, s, window.replica,
      stage_state(ctx, s, carry))


def no_output(ctx: Stages) -> TaskOutput:
  width = ctx.program.backward_width
  zeros = lambda layout: {} if layout is None else zero_row(  # pylint: disable=unnecessary-lambda-assignment
      layout.packing.lengths)
  scratch = jnp.asarray(ctx.program.num_slots, jnp.int32)
  return TaskOutput(
      zero_row(ctx.boundaries.acts.lengths),
      zero_row(ctx.boundaries.cots.lengths, (width,)),
      zeros(ctx.residuals), scratch, zeros(ctx.split), scratch)


def add_losses(carry: TickCarry, total, count, metrics: dict) -> TickCarry:
  """The carry with `count` micro-batches' losses and metrics (sums) added,
  in the carry's float32 (a float64 model's losses too)."""
  add = lambda a, v: a + jnp.asarray(v, a.dtype)  # pylint: disable=unnecessary-lambda-assignment
  return carry._replace(
      loss_sum=add(carry.loss_sum, total), num_losses=carry.num_losses + count,
      metric_sums=jax.tree.map(add, carry.metric_sums, metrics))


def zero_objective(ctx: Stages):
  """Zeros shaped like the last stage's objective: (loss, metrics)."""
  return jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), ctx.objective)


def stage_state(ctx: Stages, s: int, carry: TickCarry):
  """Stage s's state (None where it has none)."""
  if ctx.state_fns[s] is None:
    return None
  return ctx.states.unpack(s, carry.stage_state)


def update_state(ctx: Stages, s: int, carry: TickCarry, weights, x
                 ) -> TickCarry:
  """The carry with stage s's state as a training forward of the bound
  input `x` leaves it (`stage.bind_state`)."""
  if ctx.state_fns[s] is None:
    return carry
  new = ctx.state_fns[s](weights, x)
  return carry._replace(stage_state=ctx.states.pack(s, new))


def idle(ctx: Stages, carry: TickCarry, instr, window: Window):
  del instr, window
  return carry, no_output(ctx)


def slot_of(ctx: Stages, instr, window: Window, offset: int = 0):
  """The buffer slot of the task's micro-batch `offset` (with the lanes'
  tick, its row among the device's slots' C + 1 rows each)."""
  C = ctx.program.num_slots
  slot = (instr.slot + window.base + offset) % C
  return slot if window.lane is None else slot + window.lane * (C + 1)


def forward(ctx: Stages, s: int, carry: TickCarry, instr, window: Window):
  """F: the stage function; the output goes on, or the loss is taken. With
  remat="residuals" it runs `jax.vjp` and keeps the pullback's residuals
  (split backward: BI's pullback and the weight ops' inputs BW reads)."""
  last = s == ctx.num_stages - 1
  weights, x = (task_weights(ctx, s, carry, instr, window),
                bound_input(ctx, s, carry, instr, window))
  target = (window_item(window.targets, instr.minibatch, instr.microbatch)
            if last else None)
  output = no_output(ctx)
  if ctx.residuals is None:
    y = ctx.fns[s](weights, x)
    out = ctx.loss_fn(y, target) if last else y
  else:
    out, kept = ctx.forwards[s](weights, x, target)
    output = output._replace(
        kept=residuals_lib.keep(ctx.residuals, s, kept),
        kept_slot=slot_of(ctx, instr, window))
  carry = update_state(ctx, s, carry, weights, x)
  if not last:
    return carry, output._replace(
        forward=ctx.boundaries.pack_input(s + 1, out))
  return add_losses(carry, out[0], 1, out[1]), output


def split_gradients(ctx: Stages, s: int, kind: kinds_lib.TaskKind,
                    carry: TickCarry, weights, kept, slot, x, target,
                    cotangent):
  """A split backward (`split_backward.py`): BI calls the kept pullback for
  the input cotangent and the weight ops' output cotangents; BW computes the
  weight gradient from those (kept by BI) and the activations F kept; B runs
  both. Returns (weight gradient, input cotangent, op cotangents), None
  where the kind does not produce it."""
  pullback, activations = kept
  g_w = g_x = None
  if kinds_lib.INPUT_COTANGENT in kind.produces:
    g_x, op_cots = split_lib.input_gradient(ctx.split.stages[s], pullback,
                                            cotangent)
  else:
    op_cots = ctx.split.packing.unpack(
        s, read_slot(carry.buffers.op_cotangents, slot))
  if kinds_lib.WEIGHT_GRADIENT in kind.produces:
    g_w = split_lib.weight_gradient(ctx.split.stages[s], weights, x, target,
                                    activations, op_cots)
  return g_w, g_x, op_cots


def gradients(ctx: Stages, s: int, kind: kinds_lib.TaskKind, carry: TickCarry,
              instr, window: Window, weights, offset: int):
  """One micro-batch's (weight gradient, input cotangent, loss, op
  cotangents) on stage s.

  Recomputes the forward from the kept input, or (remat="residuals", a task
  that does not run the forward) calls what the forward kept: the pullback,
  or with a split backward (`split_gradients`) BI's pullback and BW's
  activations. The output's cotangent comes from the next stage, or on the
  last stage from the loss, divided by M as the minibatch's mean. The op
  cotangents are None unless the backward is split.
  """
  last, M = s == ctx.num_stages - 1, ctx.num_microbatches
  x = bound_input(ctx, s, carry, instr, window, offset)
  slot = slot_of(ctx, instr, window, offset)
  target = (window_item(window.targets, instr.minibatch,
                        instr.microbatch + offset) if last else None)
  loss = zero_objective(ctx)
  if ctx.residuals is not None and not kind.runs_forward:
    row = read_slot(carry.buffers.residuals, slot)
    kept = residuals_lib.restore(ctx.residuals, s, row, weights, x, target)
  else:
    value, kept = residuals_lib.vjp(ctx.fns[s], ctx.loss_fn, last)(
        weights, x, target)
    loss = value if last else loss
  cotangent = ((jnp.asarray(1.0 / M, ctx.objective[0].dtype),
                zero_objective(ctx)[1]) if last
               else ctx.boundaries.unpack_cotangent(
                   s + 1, read_slot(carry.buffers.cots, slot)))
  if ctx.split is not None and not kind.runs_forward:
    g_w, g_x, op_cots = split_gradients(ctx, s, kind, carry, weights, kept,
                                        slot, x, target, cotangent)
  else:
    (g_w, g_x), op_cots = kept(cotangent), None
  return g_w, stage_lib.input_cotangent(g_x, ctx.wants[s]), loss, op_cots


def backward(ctx: Stages, s: int, kind: kinds_lib.TaskKind, carry: TickCarry,
             instr, window: Window):
  """A task that produces gradients: the weight gradient (in pieces,
  `Packing.pieces`; the caller adds it to the minibatch's, `run_tasks`) and
  the input's cotangent to send back, as far as its kind produces them
  (nF1B: for every micro-batch of the minibatch); BI of a split backward
  keeps the weight ops' output cotangents for BW. Returns (carry, output,
  the weight gradient's pieces or None)."""
  weights = task_weights(ctx, s, carry, instr, window)
  grads, sends, losses = None, [], zero_objective(ctx)
  for w in range(ctx.program.backward_width):
    g_w, g_x, loss, op_cots = gradients(ctx, s, kind, carry, instr, window,
                                        weights, w)
    if kind.runs_forward:
      carry = update_state(ctx, s, carry, weights,
                           bound_input(ctx, s, carry, instr, window, w))
    if kinds_lib.WEIGHT_GRADIENT in kind.produces:
      grads = g_w if grads is None else jax.tree.map(jnp.add, grads, g_w)
    losses = jax.tree.map(jnp.add, losses, loss)
    # Stage 0 sends no cotangent; integer leaves (token ids) have none.
    sends.append(ctx.boundaries.pack_cotangent(s, g_x) if s > 0
                 and g_x is not None else zero_row(ctx.boundaries.cots.lengths))
  if kind.runs_forward and s == ctx.num_stages - 1:
    carry = add_losses(carry, *losses[:1], ctx.program.backward_width,
                       losses[1])
  out = no_output(ctx)
  if kinds_lib.INPUT_COTANGENT in kind.produces:
    out = out._replace(backward=jax.tree.map(lambda *r: jnp.stack(r), *sends))
  if op_cots is not None and kinds_lib.WEIGHT_GRADIENT not in kind.produces:
    out = out._replace(op_cotangents=ctx.split.packing.pack(s, op_cots),
                       op_cotangents_slot=slot_of(ctx, instr, window))
  if grads is None:
    return carry, out, None
  if ctx.sharded is not None:
    return carry, out, gradient_rows(ctx, s, grads)
  return carry, out, ctx.params.pieces(s, grads)


def run_task(ctx: Stages, s: int, kind: kinds_lib.TaskKind, carry: TickCarry,
             instr, window: Window):
  """Stage s runs a task of `kind`, as the kind declares: (carry, output,
  the weight gradient's pieces or None). Its ops are named `stage<s>/<kind>`
  (`jax.named_scope`) in the compiled program and in profiler traces."""
  with jax.named_scope(f"stage{s}/{kind.name}"):
    if kind.runs_backward:
      return backward(ctx, s, kind, carry, instr, window)
    return (*forward(ctx, s, carry, instr, window), None)


def task_branches(ctx: Stages) -> list[list[Callable]]:
  """`[stage][code]`: the function each stage runs for each kind code."""
  kinds = [kinds_lib.kind(name) for name in ctx.program.kinds]
  return [[lambda c, i, w: (*idle(ctx, c, i, w), None)]
          + [lambda c, i, w, s=s, k=k: run_task(ctx, s, k, c, i, w)
             for k in kinds]
          for s in range(ctx.num_stages)]


def run_tasks(ctx: Stages, carry: TickCarry, instr, window: Window):
  """The stage's task, dispatched (`ctx.lowering`) in two groups under one
  two-way `cond`: the kinds that produce a weight gradient, and the rest.

  Neither group's branches take or return the gradient accumulator: the
  first returns the task's gradient in pieces (`Packing.pieces`), which are
  joined and added outside its branches in one fused pass, and the second
  leaves the accumulator to the `cond`, whose other branch passes it
  through. XLA:CPU copies, in every branch of a multi-way conditional that
  passes a buffer through, each buffer that another branch changes; a
  two-way `cond` copies nothing when its changing branch updates the buffer
  elementwise. So no tick copies the accumulator (2 MB per stage of the
  benchmarks' MLP), and no branch packs a copy of the gradient.
  """
  branches = task_branches(ctx)
  kinds = [kinds_lib.kind(name) for name in ctx.program.kinds]
  adds = gradient_codes(ctx)
  rest = [c for c in range(1, len(kinds) + 1) if c not in adds]
  zeros = zero_gradient(ctx)

  def group(codes, c, gradient):
    # Code 0 (idle) stays first in each group, as every lowering expects.
    position = np.zeros(len(kinds) + 1, np.int32)
    position[codes] = np.arange(1, len(codes) + 1)
    rows = [[lambda *a, fn=branches[s][code]: gradient(*fn(*a))
             for code in [0] + codes] for s in window.candidates]
    return ctx.lowering(window.choice, jnp.asarray(position)[instr.kind],
                        rows, c._replace(grads=(), grads_spent=()), instr,
                        window)

  def adding(c):
    done, output, gradient = group(
        adds, c, lambda d, o, g: (d, o, zeros if g is None else g))
    if ctx.sharded is not None:  # reduce-scattered outside, `add_gradient`
      return done._replace(grads=c.grads, grads_spent=c.grads_spent), (
          output, gradient)
    if window.lane is not None:  # the slots' accumulators, `[v, L]`
      return done._replace(**stacked_sum(c, window.lane,
                                         ctx.params.join(gradient))), output
    grads = jax.tree.map(jnp.add, accumulated(c), ctx.params.join(gradient))
    return done._replace(grads=grads, grads_spent=jnp.zeros((), bool)), output

  def not_adding(c):
    done, output = group(rest, c, lambda d, o, g: (d, o))
    if ctx.sharded is not None:
      output = (output, zeros)
    return done._replace(grads=c.grads, grads_spent=c.grads_spent), output

  if not adds:
    return not_adding(carry)
  return jax.lax.cond(jnp.isin(instr.kind, np.asarray(adds)), adding,
                      not_adding, carry)


def put_row(stacked: jax.Array, row, value) -> jax.Array:
  """`stacked` with `value` in row `row` (traced, in range), in place: a
  dynamic-update-slice, where `.at[row].set` is a scatter whose bounds
  check XLA:CPU fuses as a select over the whole array (and copies it)."""
  return jax.lax.dynamic_update_index_in_dim(stacked, value, row, 0)


def stacked_sum(carry: TickCarry, slot, gradient) -> dict:
  """`accumulated` plus `gradient` on row `slot` of the slots' stacked
  accumulators (the lanes' tick, `lanes.py`), written in place: a tick that
  adds no gradient reads and writes none of them."""
  spent = carry.grads_spent[slot]
  return {"grads": jax.tree.map(
      lambda g, n: put_row(g, slot, jnp.where(spent, n, g[slot] + n)),
      carry.grads, gradient),
          "grads_spent": carry.grads_spent.at[slot].set(False)}


def gradient_codes(ctx: Stages) -> list[int]:
  """The kind codes whose tasks produce a weight gradient."""
  return [c for c, name in enumerate(ctx.program.kinds, start=1)
          if kinds_lib.WEIGHT_GRADIENT in kinds_lib.kind(name).produces]


def zero_gradient(ctx: Stages):
  """Zeros shaped as a task's weight gradient leaves its branch: pieces
  (`Packing.pieces`), or on a sharded stage `gradient_rows`."""
  if ctx.sharded is None:
    shapes = jax.eval_shape(lambda t: ctx.params.pieces(0, t),
                            ctx.params.trees[0])
  else:
    shapes = jax.eval_shape(lambda t: gradient_rows(ctx, 0, t),
                            ctx.sharded.params.full[0])
  return jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), shapes)


def add_gradient(ctx: Stages, carry: TickCarry, rows, instr) -> TickCarry:
  """A sharded stage's task gradient (`gradient_rows`, zeros where the task
  produced none), reduce-scattered over 'fsdp' outside every conditional
  and added to this member's part of the accumulator."""
  produced = jnp.isin(instr.kind, np.asarray(gradient_codes(ctx) or [-1]))
  part = fsdp.scatter_mean(rows, ctx.sharded.size)
  grads = jax.tree.map(lambda a, g, old: jnp.where(produced, a + g, old),
                       accumulated(carry), part, carry.grads)
  return carry._replace(grads=grads, grads_spent=jnp.where(
      produced, jnp.zeros((), bool), carry.grads_spent))


def keep_residuals(carry: TickCarry, output: TaskOutput) -> TickCarry:
  """Writes the forward's residuals and BI's op cotangents into their slots
  (or the scratch slot)."""
  write = lambda buffer, row, slot: {k: v.at[slot].set(row[k])  # pylint: disable=unnecessary-lambda-assignment
                                     for k, v in buffer.items()}
  buffers = carry.buffers
  return carry._replace(buffers=buffers._replace(
      residuals=write(buffers.residuals, output.kept, output.kept_slot),
      op_cotangents=write(buffers.op_cotangents, output.op_cotangents,
                          output.op_cotangents_slot)))


def hop(placement: placement_lib.Placement, x, hop_: placement_lib.Hop,
        device, into=None):
  """`into` (slot `hop_.dest`'s rows so far; None: none yet) with what this
  device receives through `hop_`: the sender's row within the device, or a
  `ppermute` along 'stage'. The `ppermute` runs every tick, never under a
  `cond`: under one, an executable that JAX's persistent compilation cache
  loaded paired the rows wrongly on XLA:CPU (jax 0.10; a freshly compiled
  one did not), so a resumed run trained on other numbers than a straight
  one (`tests/compilation_cache_test.py`)."""
  P, hop = placement.num_devices, hop_

  def select(devices, a, b):  # a on `devices`, b elsewhere
    if len(devices) == P:  # every device (one device: all of a fold's hops)
      return a
    if b is None:
      b = jax.tree.map(jnp.zeros_like, a)
    return jax.tree.map(lambda u, v: jnp.where(jnp.asarray(np.isin(
        np.arange(P), devices))[device], u, v), a, b)

  if hop.local():
    into = select(hop.local(), x, into)
  remote = hop.remote()
  if remote:
    moved = jax.lax.ppermute(x, STAGE, [(d, e) for d, e, _ in remote])
    into = select([e for _, e, _ in remote], moved, into)
  return into


class Outbox(NamedTuple):
  """What a slot's task sent in its last tick, which the receivers file at
  the start of the next tick (`receive`): the rows wait in the sender's
  carry, which its task overwrites in place. (Rows waiting in the
  receiver's carry would be copied twice a tick: out of the sender's branch,
  and to keep the ones they replace until filed; here XLA copies each once,
  for the read before the overwrite.)"""

  forward: packing.Flat  # dtype -> [A]: an activation, to stage s+1
  backward: packing.Flat  # dtype -> [W, A']: cotangents, to stage s-1


def empty_outbox(ctx: Stages) -> Outbox:
  output = no_output(ctx)
  return Outbox(output.forward, output.backward)


def file_rows(ctx: Stages, buffers: Buffers, forward, backward, previous,
              window: Window) -> Buffers:
  """`buffers` with the rows that arrived (None: no hop brings any to this
  slot) in the buffer slots the stage's row of last tick names
  (`previous`), or the scratch slot C where it names none."""
  C, W = ctx.program.num_slots, ctx.program.backward_width
  slot = lambda at, w=0: jnp.where(at >= 0, (at + window.base + w) % C, C)  # pylint: disable=unnecessary-lambda-assignment
  acts, cots = buffers.acts, buffers.cots
  if forward is not None:
    acts = {k: v.at[slot(previous.recv_forward)].set(forward[k])
            for k, v in acts.items()}
  if backward is not None:
    for w in range(W):
      cots = {k: v.at[slot(previous.recv_backward, w)].set(backward[k][w])
              for k, v in cots.items()}
  return buffers._replace(acts=acts, cots=cots)


def receive(ctx: Stages, carries: list, previous, windows: list,
            device) -> list:
  """Every slot files what its neighbours sent last tick (`Outbox`), moved
  to the next stage (activations) or the previous one (cotangents),
  wherever the placement holds it (`placement.Hop`). `previous`: every
  stage's row of last tick. On a folded device a slot with nothing to file
  skips it under a two-way `cond`."""
  rows = {}
  for field, step in (("forward", 1), ("backward", -1)):
    for h in ctx.placement.hops(step):
      rows[field, h.dest] = hop(ctx.placement,
                                getattr(carries[h.source].outbox, field), h,
                                device, rows.get((field, h.dest)))
  filed = []
  for j, (c, w) in enumerate(zip(carries, windows)):
    last = jax.tree.map(lambda column, w=w: column[w.stage], previous)
    file = functools.partial(file_rows, ctx, forward=rows.get(("forward", j)),
                             backward=rows.get(("backward", j)),
                             previous=last, window=w)
    buffers = file(c.buffers) if len(carries) == 1 else jax.lax.cond(
        (last.recv_forward >= 0) | (last.recv_backward >= 0), file,
        lambda b: b, c.buffers)
    filed.append(c._replace(buffers=buffers))
  return filed


def optimizer_step(ctx: Stages, s: int, carry: TickCarry, grads, instr):
  """Stage s's optimizer on the minibatch's gradient: the new packed weights
  and optimizer state. Update rules that take extra arguments get the
  weights the gradient used (`stale_params`), the updates applied since its
  forward read (`staleness`) and this replica's own gradient
  (`local_updates`; `grads` may be the replicas' mean)."""
  current = ctx.params.unpack(s, read_version(carry.ring, 0))
  opt_state = ctx.opt.unpack(s, carry.opt_state)
  kwargs = contract.extra_args(
      ctx.optimizer, ctx.stale_schedule,
      stale_params=ctx.params.unpack(s, read_version(carry.ring,
                                                     instr.update_lag)),
      staleness=instr.update_staleness,
      local_updates=ctx.params.unpack(s, accumulated(carry)))
  updates, opt_state = ctx.optimizer.update(ctx.params.unpack(s, grads),
                                            opt_state, current, **kwargs)
  return (ctx.params.pack(s, optax.apply_updates(current, updates)),
          ctx.opt.pack(s, opt_state))


def gathered_inputs(ctx: Stages, carry: TickCarry, grads, instr) -> dict:
  """A sharded stage's update inputs gathered over 'fsdp' (`[F, L]` per
  dtype), for a rule that is not elementwise (`gathered_step`)."""
  return {name: fsdp.gather(flat) for name, flat in (
      ("current", read_version(carry.ring, 0)),
      ("stale", read_version(carry.ring, instr.update_lag)),
      ("grads", grads), ("local", accumulated(carry)),
      ("opt", carry.opt_state))}


def gathered_step(ctx: Stages, s: int, carry: TickCarry, gathered, instr):
  """`optimizer_step` on a sharded stage's whole tree (`gathered_inputs`):
  the rule sees the stage as the unsharded run does (a global norm, full
  delay compensation's `<g, dx>`, Muon's whole matrices); this member keeps
  its part of the new weights and state."""
  del carry
  tree = lambda name: merged(ctx, s, gathered[name])  # pylint: disable=unnecessary-lambda-assignment
  current = tree("current")
  kwargs = contract.extra_args(
      ctx.optimizer, ctx.stale_schedule, stale_params=tree("stale"),
      staleness=instr.update_staleness, local_updates=tree("local"))
  updates, opt_state = ctx.optimizer.update(
      tree("grads"), merged(ctx, s, gathered["opt"], ctx.sharded.opt,
                            ctx.opt), current, **kwargs)
  return (own_part(ctx, s, optax.apply_updates(current, updates)),
          own_part(ctx, s, opt_state, ctx.sharded.opt, ctx.opt))


def model_step(ctx: Stages, carries, grads, instr):
  """The optimizer on the whole model (`scope.py`): every stage's gradient,
  weights and extra arguments gathered over this device's slots and over
  'stage', the rule stepped on the whole model's tree (`scope.join` of the
  S stage trees) with the whole model's state (each stage holds a copy). Every device computes the
  same update; returns the S new stage trees and the new state."""
  stages = ctx.placement.stages
  sharded = ctx.sharded is not None

  def whole(flats):
    if sharded:  # each member's part first: [P, F, L]
      flats = [fsdp.gather(flat) for flat in flats]
    gathered = [{k: jax.lax.all_gather(v, STAGE) for k, v in flat.items()}
                for flat in flats]
    row = lambda j, d: {k: v[d] for k, v in gathered[j].items()}  # pylint: disable=unnecessary-lambda-assignment
    trees = {int(s): merged(ctx, int(s), row(j, d)) if sharded
             else ctx.params.unpack(int(s), row(j, d))
             for (d, j), s in np.ndenumerate(stages)}
    return tuple(trees[s] for s in range(ctx.num_stages))

  stage_trees = whole([read_version(c.ring, 0) for c in carries])
  join = functools.partial(scope_lib.join, tied=ctx.tied)
  add = functools.partial(scope_lib.join, tied=ctx.tied, add=True)
  current = join(stage_trees)
  kwargs = contract.extra_args(
      ctx.optimizer, ctx.stale_schedule,
      stale_params=join(whole([read_version(c.ring, instr.update_lag)
                               for c in carries])),
      staleness=instr.update_staleness,
      local_updates=add(whole([accumulated(c) for c in carries])))
  opt_state = (merged(ctx, 0, fsdp.gather(carries[0].opt_state),
                      ctx.sharded.opt, ctx.opt) if sharded
               else ctx.opt.unpack(0, carries[0].opt_state))
  updates, opt_state = ctx.optimizer.update(add(whole(grads)), opt_state,
                                            current, **kwargs)
  return (scope_lib.parts(optax.apply_updates(current, updates), stage_trees,
                          ctx.tied), opt_state)


def write_version(ring: WeightRing | pool_lib.PoolView, params: packing.Flat,
                  evict, evict_slot) -> WeightRing | pool_lib.Write:
  """Stores the next version, over the slot of the version `evict` updates
  behind the latest (or an empty slot when `evict` < 0); in a pooled stash,
  the `pool.Write` of the row `evict_slot` and `evict` name, which
  `pooled_updates` stores."""
  if isinstance(ring, pool_lib.PoolView):
    return pool_lib.write(ring, params, evict, evict_slot)
  slot = jnp.where(evict >= 0, ring_slot(ring.versions, ring.latest - evict),
                   ring_slot(ring.versions, -1))
  return WeightRing(
      params={k: v.at[slot].set(params[k]) for k, v in ring.params.items()},
      versions=ring.versions.at[slot].set(ring.latest + 1),
      latest=ring.latest + 1)


@jax.named_scope("update")
def apply_update(ctx: Stages, window: Window, carry: TickCarry, instr, grads,
                 step: Callable) -> TickCarry:
  """The minibatch's update on this slot's stage, with the sync policy
  around it (its ops named `update` in the compiled program and profiler
  traces): `step(s, carry, grads, instr)` gives stage s's new packed weights
  and optimizer state from `grads`, the policy's reduced gradient.

  Only the optimizer step depends on the stage (its layout); the policy's
  collectives run once, outside any stage-dependent branch.
  """
  (params, opt_state), _ = ctx.lowering(
      window.choice, 1,
      [[lambda c, g, i: ((read_version(c.ring, 0), c.opt_state), ()),
        lambda c, g, i, s=s: (step(s, c, g, i), ())]
       for s in window.candidates], carry, grads, instr)
  rel = instr.update_minibatch
  event = sync_lib.UpdateEvent(
      minibatch=(window.step - ctx.program.history) * ctx.window_minibatches
      + rel, stage=window.stage, replica=window.replica,
      plan={k: v[rel] for k, v in window.plan.items()})
  params, sync_state = ctx.sync.after_update(
      params, read_version(carry.ring, 0), carry.sync, event, DATA)
  return carry._replace(
      ring=write_version(carry.ring, params, instr.evict, instr.evict_slot),
      opt_state=opt_state,
      grads_spent=jnp.ones((), bool), sync=sync_state)


def reduced_gradient(ctx: Stages, carry: TickCarry):
  """The minibatch's gradient as the sync policy reduces it over 'data'."""
  return ctx.sync.reduce_gradient(accumulated(carry), DATA)


def pooled_updates(ctx: Stages, windows, carries, instrs, own, inputs
                   ) -> tuple:
  """`apply_updates` on a pooled stash (`pool.py`): the slots update one
  after another, each on the pool as the one before left it; the pool
  enters each update's conditional as an operand only, and the new version
  is stored after it (`pool.claim`)."""
  done, view = [], carries[-1].ring  # as the last slot's task left it
  after_tasks = sum(c.num_losses for c in carries) >= 0  # True (`claim`)
  for w, c, i in zip(windows, carries, instrs):
    view = pool_lib.rebase(c.ring, view)

    def update(c, w=w, i=i, view=view):
      c = c._replace(ring=view)
      return apply_update(ctx, w, c, i, inputs(c, i), own)

    c = jax.lax.cond(i.update == 1, update,
                     lambda c, view=view: c._replace(
                         ring=pool_lib.no_write(view)),
                     c._replace(ring=None))
    view = pool_lib.claim(view, c.ring, after_tasks)
    done.append(c._replace(ring=view))
  return tuple(done)


def apply_updates(ctx: Stages, windows, carries, instrs) -> tuple:
  """Each slot's update where its row names one: its stage's own
  (`optimizer_step`), or with the model scope one step of the whole model,
  which every stage applies at the same tick (`Schedule.together`)."""
  if not ctx.whole_model:
    if ctx.sharded is None or ctx.sharded.elementwise:
      own, inputs = functools.partial(optimizer_step, ctx), (
          lambda c, i: reduced_gradient(ctx, c))
    else:  # the gathers run before the per-stage branch, not inside it
      own, inputs = functools.partial(gathered_step, ctx), (
          lambda c, i: gathered_inputs(ctx, c, reduced_gradient(ctx, c), i))
    if isinstance(carries[0].ring, pool_lib.PoolView):
      return pooled_updates(ctx, windows, carries, instrs, own, inputs)
    return tuple(jax.lax.cond(
        i.update == 1,
        lambda c, w=w, i=i: apply_update(ctx, w, c, i, inputs(c, i), own),
        lambda c: c, c) for w, c, i in zip(windows, carries, instrs))

  def together(cs):
    grads = [reduced_gradient(ctx, c) for c in cs]
    new, new_state = model_step(ctx, cs, grads, instrs[0])
    if ctx.sharded is not None:
      step = lambda s, c, g, i: (  # pylint: disable=unnecessary-lambda-assignment
          own_part(ctx, s, new[s]),
          own_part(ctx, s, new_state, ctx.sharded.opt, ctx.opt))
    else:
      step = lambda s, c, g, i: (ctx.params.pack(s, new[s]),  # pylint: disable=unnecessary-lambda-assignment
                                 ctx.opt.pack(s, new_state))
    return tuple(apply_update(ctx, w, c, i, g, step)
                 for w, c, i, g in zip(windows, cs, instrs, grads))

  return jax.lax.cond(instrs[0].update == 1, together, lambda cs: cs,
                      tuple(carries))


def _blank(name: str, column: jax.Array) -> jax.Array:
  """One tick of table column `name` in which a stage does nothing."""
  return jnp.full_like(column[:1], program_lib.blank(name))


def with_closing_tick(table: program_lib.Instructions
                      ) -> program_lib.Instructions:
  """A window's table `[T, S]` with one blank tick after its last, in which
  each stage only files what arrived in the last tick: so the window's loop
  files that too (filed after the loop, XLA would copy every stage's buffers
  to update them) and the next window's first tick has nothing to file."""
  return program_lib.Instructions(*[
      jnp.concatenate([c, _blank(name, c)])
      for name, c in zip(program_lib.Instructions._fields, table)])


def last_tick(table: program_lib.Instructions) -> program_lib.Instructions:
  """Every stage's row of the tick before, per tick (blank before the
  first: a window's first tick files nothing, `with_closing_tick`)."""
  return program_lib.Instructions(*[
      jnp.concatenate([_blank(name, c), c[:-1]])
      for name, c in zip(program_lib.Instructions._fields, table)])


def run_slot(ctx: Stages, carry: TickCarry, instr, window: Window):
  """A slot's task, what it sends written over its outbox; a slot with no
  task skips it under one two-way `cond` (a folded device's stages are idle
  most ticks of a deep synchronous schedule)."""
  sharded = ctx.sharded is not None

  def work(c):
    c, output = run_tasks(ctx, c, instr, window)
    output, rows = output if sharded else (output, None)
    c = keep_residuals(c, output)._replace(
        outbox=Outbox(output.forward, output.backward))
    return (c, rows) if sharded else c

  if ctx.placement.num_slots == 1:
    done = work(carry)
  else:
    done = jax.lax.cond(
        instr.kind != program_lib.IDLE, work,
        lambda c: (c, zero_gradient(ctx)) if sharded else c, carry)
  # A sharded stage's gradient is reduce-scattered here, outside any cond.
  return add_gradient(ctx, *done, instr) if sharded else done


def tick(ctx: Stages, window: Window, carries: tuple, xs):
  """One tick on this device: each slot files what its neighbours sent last
  tick, runs its stage's task and writes what it sends into its outbox
  (`xs`: every stage's row of this tick and of the last, `last_tick`), then
  the updates."""
  rows, previous = xs
  windows = [at_slot(ctx, window, j) for j in range(len(carries))]
  instrs = [jax.tree.map(lambda column, w=w: column[w.stage], rows)
            for w in windows]
  carries = receive(ctx, list(carries), previous, windows, window.device)
  if ctx.sharded is not None:  # each slot's version, gathered before its task
    windows = [w._replace(gathered=window.once[j] if ctx.gather_once
                          else fsdp.gather(predicted_part(ctx, c, i, w)))
               for j, (w, c, i) in enumerate(zip(windows, carries, instrs))]
  done = []
  for w, c, i in zip(windows, carries, instrs):
    if done and isinstance(c.ring, pool_lib.PoolView):
      # The pool passes through each slot's task in turn: given to every
      # task at once, XLA would copy it for each.
      c = c._replace(ring=pool_lib.rebase(c.ring, done[-1].ring))
    done.append(run_slot(ctx, c, i, w))
  return apply_updates(ctx, windows, done, instrs), None
