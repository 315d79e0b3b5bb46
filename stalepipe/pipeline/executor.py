"""The shard_map executor: one jitted SPMD program runs any schedule.

The mesh has axes ('data', 'stage'). Each stage's weight versions, optimizer
state and gradient accumulator live on its 'stage' slice, packed into flat
per-dtype buffers (`packing.py`) so that stages of different structure share
one program. A `lax.scan` over the ticks of a window runs, on every stage, the
task its row of the instruction tables names (`program.py`); `tick.py` holds
the tick as pure functions, `state.py` the typed state, `dispatch.py` how a
tick picks each stage's task.

Plug-in points (each declared once, never by name in here):

- task kinds (`stalepipe.schedules.kinds`): what a task consumes, produces
  and whether it closes an update; the executor builds one branch per kind;
- sync policies (`stalepipe.sync`): `reduce_gradient` before the optimizer,
  `after_update` after it, with collectives over 'data';
- update rules: any optax transformation; a `GradientTransformationExtraArgs`
  (or an optimizer with `predict`) also gets `stale_params`, `staleness` and
  `local_updates`, and an optimizer with `predict(state, weights, *, ahead,
  since_forward)` decides the weights every forward and backward reads;
- lowerings (`dispatch.LOWERINGS`): how the per-stage, per-kind choice is
  compiled.

Every task reads the weight version the schedule's version map names, from a
ring of R versions per stage (R: the schedule's stash depth). Activations and
cotangents move one hop per tick with `ppermute` along 'stage' and wait in
per-stage buffer slots until their task runs. Work in flight at the end of a
window (activations, stashes, partial gradients, inputs of minibatches not
yet finished) stays in the state, so K windows give exactly one schedule over
K*B minibatches.
"""

import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stalepipe import sync as sync_lib
from stalepipe.pipeline import boundary as boundary_lib
from stalepipe.pipeline import contract
from stalepipe.pipeline import dispatch
from stalepipe.pipeline import forward_only
from stalepipe.pipeline import fsdp as fsdp_lib
from stalepipe.pipeline import lanes as lanes_lib
from stalepipe.pipeline import packing
from stalepipe.pipeline import pool as pool_lib
from stalepipe.pipeline import placement as placement_lib
from stalepipe.pipeline import program as program_lib
from stalepipe.pipeline import reshard as reshard_lib
from stalepipe.pipeline import residuals as residuals_lib
from stalepipe.pipeline import scope as scope_lib
from stalepipe.pipeline import split_backward as split_lib
from stalepipe.pipeline import stage as stage_lib
from stalepipe.pipeline import tick as tick_lib
from stalepipe.pipeline.state import (Buffers, InputHistory, PipelineState,
                                      TickCarry, WeightRing, local, unlocal)
from stalepipe.schedules import Schedule
from stalepipe.schedules import kinds as kinds_lib

DATA, STAGE, FSDP = tick_lib.DATA, tick_lib.STAGE, fsdp_lib.FSDP
_PER_DEVICE, _WINDOW = P(DATA, STAGE), P(None, None, DATA)


def state_specs(state: PipelineState, device: P = _PER_DEVICE,
                window: P = _WINDOW) -> PipelineState:
  """The partition spec of every leaf of `state`, as a matching tree
  (`device`: a per-stage field's; `window`: the kept inputs')."""
  per_device = lambda tree: jax.tree.map(lambda _: device, tree)  # pylint: disable=unnecessary-lambda-assignment
  return PipelineState(
      ring=per_device(state.ring), opt_state=per_device(state.opt_state),
      grads=per_device(state.grads), buffers=per_device(state.buffers),
      history=jax.tree.map(lambda _: window, state.history),
      sync=per_device(state.sync), step=P(),
      stage_state=per_device(state.stage_state),
      drained=None if state.drained is None else P())


def _ticks(ctx: tick_lib.Stages, window: tick_lib.Window, carries: tuple,
           table: program_lib.Instructions) -> tuple:
  """The window's loop over its ticks (`table`, with its closing tick): the
  slots' tick, or the lanes' (`lanes.py`) on the slots stacked for it."""
  xs = (table, tick_lib.last_tick(table))
  if ctx.lanes is None and isinstance(carries[0].ring, pool_lib.StashPool):
    return _pooled_ticks(ctx, window, carries, xs)
  if ctx.lanes is None:
    return jax.lax.scan(functools.partial(tick_lib.tick, ctx, window),
                        carries, xs)[0]
  K = ctx.lanes.shape[0]
  slots = jnp.asarray(ctx.lanes)[jnp.minimum(window.step, K - 1)]
  slots = jnp.concatenate([slots, jnp.full_like(slots[:1], -1)])
  carry, _ = jax.lax.scan(functools.partial(lanes_lib.tick, ctx, window),
                          lanes_lib.stack(ctx, carries), (*xs, slots))
  return lanes_lib.unstack(ctx, carry)


def _pooled_ticks(ctx: tick_lib.Stages, window: tick_lib.Window,
                  carries: tuple, xs) -> tuple:
  """The slots' tick on a pooled stash (`pool.py`): the pool is carried
  once, each slot given its view for the tick; returns the carries with the
  pool in slot 0's `ring` (as `run_window` passes it)."""
  def step(carry, xs):
    rest, pool = carry
    rest, _ = tick_lib.tick(ctx, window, tuple(
        c._replace(ring=v) for c, v in zip(rest, pool_lib.views(pool))), xs)
    return (tuple(c._replace(ring=None) for c in rest),
            pool_lib.joined([c.ring for c in rest])), None

  rest = tuple(c._replace(ring=None) for c in carries)
  (rest, pool), _ = jax.lax.scan(step, (rest, carries[0].ring), xs)
  return (rest[0]._replace(ring=pool),) + rest[1:]


def run_window(ctx: tick_lib.Stages, state: PipelineState, inputs, targets,
               tables: program_lib.Instructions, plan: dict):
  """The shard_map body: one window's ticks on one device.

  Returns:
    The new state (this device's blocks) and the window's metrics: its mean
    loss, the number of losses it took, and the stages' metrics, each its
    mean over those micro-batches.
  """
  H, B = ctx.program.history, ctx.window_minibatches
  C, K = ctx.program.num_slots, ctx.program.tables.kind.shape[0]
  step = state.step
  past = lambda kept, now: now if kept is None else jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
      lambda k, n: jnp.concatenate([k, n]), kept, now)
  window = tick_lib.Window(
      inputs=past(state.history.inputs, inputs),
      targets=past(state.history.targets, targets), plan=plan,
      base=(step % C) * (B * ctx.num_microbatches % C) % C, step=step,
      stage=jax.lax.axis_index(STAGE), replica=jax.lax.axis_index(DATA),
      device=jax.lax.axis_index(STAGE))
  at = functools.partial(local, lead=ctx.lead)
  carries = tuple(TickCarry(
      ring=at(state.ring, min(j, len(state.ring) - 1)),  # a pool: slot 0's
      opt_state=at(state.opt_state, j),
      grads=at(state.grads, j), grads_spent=jnp.zeros((), bool),
      buffers=at(state.buffers, j), sync=at(state.sync, j),
      loss_sum=jnp.zeros((), jnp.float32), num_losses=jnp.zeros((), jnp.int32),
      metric_sums=tick_lib.zero_objective(ctx)[1],
      stage_state=at(state.stage_state, j),
      outbox=tick_lib.empty_outbox(ctx))
                  for j in range(ctx.placement.num_slots))
  if ctx.gather_once:  # every task of the window reads this version
    window = window._replace(once=tuple(
        fsdp_lib.gather(tick_lib.read_version(c.ring, 0)) for c in carries))
  table = tick_lib.with_closing_tick(jax.tree.map(
      lambda c: jax.lax.dynamic_index_in_dim(c, jnp.minimum(step, K - 1),
                                             keepdims=False), tables))
  carries = _ticks(ctx, window, carries, table)
  total = lambda get: jax.lax.psum(sum(get(c) for c in carries), STAGE)  # pylint: disable=unnecessary-lambda-assignment
  num_losses = total(lambda c: c.num_losses)
  mean = lambda value: jax.lax.pmean(value, ctx.batch_axes) / jnp.where(  # pylint: disable=unnecessary-lambda-assignment
      num_losses > 0, num_losses, jnp.nan)
  loss = mean(total(lambda c: c.loss_sum))
  metrics = {k: mean(total(lambda c, k=k: c.metric_sums[k]))
             for k in carries[0].metric_sums}
  keep = lambda tree: None if H == 0 else jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
      lambda x: x[x.shape[0] - H * B:], tree)
  back = functools.partial(unlocal, lead=ctx.lead)
  new = PipelineState(
      ring=back([c.ring for c in carries[:len(state.ring)]]),
      opt_state=back([c.opt_state for c in carries]),
      grads=back([tick_lib.accumulated(c) for c in carries]),
      buffers=back([c.buffers for c in carries]),
      history=InputHistory(keep(window.inputs), keep(window.targets)),
      sync=back([c.sync for c in carries]), step=step + 1,
      stage_state=back([c.stage_state for c in carries]))
  return new, {"loss": loss, "num_losses": num_losses, **metrics}


def throughput(inputs, targets, seconds: float) -> dict[str, float]:
  """A window's wall time, examples/s and (sequence targets) tokens/s, from
  the mesh-wide inputs and targets `[B, M, D*b, ...]`."""
  examples = int(np.prod(jax.tree.leaves(inputs)[0].shape[:3]))
  out = {"seconds": seconds, "examples_per_s": examples / seconds}
  target = jax.tree.leaves(targets)[0]
  if target.ndim > 3:
    out["tokens_per_s"] = int(np.prod(target.shape)) / seconds
  return out


def process_slice(x, mesh: Mesh, process_index: int | None = None):
  """This process's slice `[B, M, D_local*b, ...]` of a global window `[B, M,
  D*b, ...]` (a pytree of such arrays): the micro-batch columns of the data
  replicas whose devices this process holds, as `Pipeline.step` takes them
  in a multi-process run.

  Examples:
    >>> # on process i of a 2-process run over a (4, S) mesh:
    >>> # pipe.step(state, *process_slice((x, y), pipe.mesh))  # doctest: +SKIP
  """
  process = jax.process_index() if process_index is None else process_index
  D = mesh.shape[DATA]
  mine = [r for r, row in enumerate(mesh.devices)
          if any(d.process_index == process for d in row.flat)]
  if not mine or mine != list(range(mine[0], mine[-1] + 1)):
    raise ValueError(f"process {process}'s data replicas {mine} are invalid; "
                     "valid: a non-empty run of consecutive replicas")

  def cut(v):
    v = np.asarray(v)
    if v.ndim < 3 or v.shape[2] % D:
      raise ValueError(f"window shape {v.shape} is invalid; valid: [B, M, a "
                       f"multiple of {D} data replicas, ...]")
    b = v.shape[2] // D
    return v[:, :, mine[0] * b:(mine[-1] + 1) * b]

  return jax.tree.map(cut, x)


class Pipeline:
  """Runs `schedule` over `mesh` with `optimizer` applied per stage.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`; stages may differ; `x`
      and `y` may be pytrees (each leaf crosses with its own dtype and
      shape); a stage may declare keyword arguments `key` and `train`
      (`stage.py`).
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters.
      A `GradientTransformationExtraArgs` also receives `stale_params=` (the
      weights the gradient was computed on), `staleness=` (updates applied to
      the stage since its forward read) and `local_updates=` (this replica's
      own gradient, where the sync policy averages the gradient). An
      optimizer with `predict(state, weights, *, ahead, since_forward)`
      (`stalepipe.optim.WeightPrediction`, `SpecTrain`, `PipeMare`) decides
      the weights every forward and backward reads.
    mesh: a mesh with axes ('data', 'stage'); its 'stage' size P must
      divide S: each device runs S/P stages (`placement`) in every tick,
      with the same numerics whatever P (one device runs the whole
      pipeline). A third axis 'fsdp' of F devices shards each stage over
      F (`fsdp.py`: its weights, stash, accumulator and optimizer state cut
      per leaf, each device taking 1/F of a micro-batch), with the
      numbers of the unsharded run.
    sync: what crosses the 'data' axis (`stalepipe.sync`); default BSP.
    lowering: how a tick dispatches each stage's task (`dispatch.LOWERINGS`).
    remat: "recompute" (a backward task recomputes the forward from the kept
      input) or "residuals" (the forward keeps `jax.vjp`'s residuals for the
      backward tasks; `residuals.py`; where the schedule has input- and
      weight-gradient tasks, BI keeps each weight op's output cotangent and
      BW computes only the weight gradient: `split_backward.py`).
    layout: how weights, optimizer state and the gradient accumulator are
      held per stage (`packing.LAYOUTS`): "packed" (one flat vector per dtype,
      any stages) or "stacked" (each leaf in its own shape, for stages of one
      structure: a task reads its weights in place and a backward adds leaf
      by leaf; zb-h1 with residuals 0.75x the MaxText-style baseline's
      step against 0.83x packed on 8 emulated CPU devices,
      docs/executor.md).
    optimizer_scope: what the update rule steps on (`scope.py`): "model"
      (all stages' trees together, each minibatch's update applied on every
      stage at one tick; equals unpipelined training; refused on schedules
      that cannot), "stage" (each stage's own tree), or "auto" (default:
      "model" where the rule couples stages, e.g. global-norm clipping or
      full delay compensation, else "stage").
    seed: whence every task's PRNG key, for stages that take `key`
      (`stage.py`: one key per minibatch, micro-batch, stage and replica).
    placement: which stages each device on 'stage' holds
      (`placement.names()`): "consecutive" (device d the d-th run of S/P
      stages), "loop" (stage s on device s mod P) or "v" (S = 2P; device r
      holds stages r and 2P-1-r). Default: a device-level schedule's own
      (interleaved-1f1b, zb-v, ...; `placement.for_schedule`), else
      "consecutive".
    tied: names of parameters several stages hold (`models.cut(...,
      tied=)`: a head tied to the embedding); their gradients are summed
      over those stages and one update applied on every copy
      (`scope.join`), with optimizer_scope "model" (or "auto").
    fsdp_rule: on a mesh ('data', 'stage', 'fsdp') of F > 1 devices a
      stage: `rule(name, shape, F) -> dim or None`, the dimension each
      weight leaf is cut along (`fsdp.py`; default its largest dimension F
      divides; None: held whole by every member).
    fsdp_gather: "task" (each task all-gathers the version it reads) or
      "window" (each slot's version gathered once a window, where every
      task of it reads that one: `fsdp.check_gather`).
    tick: "slots" (every slot of a device runs its conditionals every
      tick), "lanes" (a device runs only its busy slots, one lane each, on
      its slots held as one array: a device-level schedule's tick costs one
      task, not one per chunk; `lanes.py`) or "auto" (default: "lanes"
      where a device has 16 times more slots than it ever runs at once,
      unsharded, optimizer_scope "stage": below that the slots' tick is
      faster on the CPU). Both train the same numbers.
    stash: "slots" (default: one ring of weight versions a slot, as deep as
      the deepest stage in that slot on any device) or "pooled" (one pool a
      device of `program.pool_size` rows, the most versions its stages keep
      at once: the schedule's per-device figure; `pool.py`). The same
      numbers; "pooled" runs unsharded, with the stage scope.

  Examples:
    >>> import jax, optax, stalepipe as sp
    >>> staged = sp.models.split(sp.models.mlp(64, 32, 3, 10), 4)
    >>> mesh = jax.make_mesh((2, 4), ("data", "stage"))
    >>> schedule = sp.schedules.make("pipedream", num_stages=4, num_microbatches=4)
    >>> pipe = Pipeline(staged.stage_fns, sp.models.losses.cross_entropy,
    ...                 schedule, optax.sgd(0.1), mesh,
    ...                 sync=sp.sync.bsp(2))  # doctest: +SKIP
    >>> state = pipe.init(staged.stage_params)  # doctest: +SKIP
    >>> state, metrics = pipe.step(state, inputs_BxMxbxD, labels_BxMxb)  # doctest: +SKIP
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation,
               mesh: Mesh, sync: sync_lib.SyncPolicy | None = None,
               lowering: str = "nested_switch", remat: str = "recompute",
               layout: str = "packed", optimizer_scope: str = "auto",
               seed: int = 0, placement: str | None = None,
               tied: Sequence[str] = (), fsdp_rule: fsdp_lib.Rule | None = None,
               fsdp_gather: str = "task", tick: str = "auto",
               stash: str = "slots"):
    if tuple(mesh.axis_names) not in ((DATA, STAGE), (DATA, STAGE, FSDP)):
      raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are invalid; "
                       f"valid: ({DATA!r}, {STAGE!r}) or ({DATA!r}, "
                       f"{STAGE!r}, {FSDP!r})")
    self.fsdp = dict(mesh.shape).get(FSDP, 1)
    self.fsdp_rule = fsdp_rule
    self.placement = placement_lib.for_schedule(schedule, mesh.shape[STAGE],
                                                placement)
    sync = sync or sync_lib.bsp(mesh.shape[DATA])
    contract.check(stage_fns, schedule, optimizer, sync, mesh.shape[DATA])
    residuals_lib.check(remat, schedule, optimizer)
    self.tied = frozenset(tied)
    self.optimizer_scope = scope_lib.resolve(optimizer_scope, optimizer,
                                             schedule, self.tied)
    if self.optimizer_scope == "model":
      schedule = schedule.together()
    self.remat = remat
    self.layout = packing.get(layout)
    self.stage_fns = tuple(stage_fns)
    self.seed = seed
    self._fns, self._state_fns, self._wants = stage_lib.bind_all(stage_fns)
    fsdp_lib.check(self.fsdp, remat, optimizer, self._wants, self.tied)
    fsdp_lib.check_gather(fsdp_gather, schedule, self.fsdp)
    self.fsdp_gather = fsdp_gather
    sharded = self.fsdp > 1
    self._device_spec = P(DATA, STAGE, FSDP) if sharded else _PER_DEVICE
    self._window_spec = P(None, None, (DATA, FSDP)) if sharded else _WINDOW
    self._lead = 3 if sharded else 2
    self._sharded = self._param_trees = None
    self.loss_fn = loss_fn
    self._loss_fn = stage_lib.bind_loss(loss_fn)
    self.schedule = schedule
    self.optimizer = optimizer
    self.mesh = mesh
    self.sync = sync
    self.lowering = dispatch.get(lowering)
    whole = self.optimizer_scope == "model"
    self.pooled = pool_lib.check(stash, self.placement.num_slots, sharded,
                                 whole)
    self.program = program_lib.compile_program(
        schedule, ring_groups=self.placement.stages.T,
        pools=self.placement.stages if self.pooled else None)
    self._stale_schedule = contract.schedule_is_stale(schedule)
    lanes = lanes_lib.plan(self.program, self.placement.stages)
    self._lanes = lanes if lanes_lib.check(
        tick, self.placement.num_slots, sharded, whole, lanes) else None
    self._param_packing = self._opt_packing = self._state_packing = None
    self._steps, self._contexts = {}, {}
    self._tables = self._static_plan = None

  @property
  def lanes(self) -> int | None:
    """Slots a device runs per tick with the lanes' tick (`lanes.py`);
    None: the slots' tick, every slot every tick."""
    return None if self._lanes is None else self._lanes.shape[-1]

  @property
  def num_replicas(self) -> int:
    return self.mesh.shape[DATA]

  @property
  def _columns(self) -> int:
    """The parts a micro-batch is split into: D replicas times F members."""
    return self.num_replicas * self.fsdp

  @property
  def replicated_leaves(self) -> list[str]:
    """Leaves of a sharded stage held whole by every member (no dimension
    'fsdp' divides), e.g. for a run's first lines; [] unsharded."""
    if self._sharded is None:
      return []
    return self._sharded.params.replicated + [
        "optimizer " + r for r in self._sharded.opt.replicated]

  def _put(self, x, spec: P):
    """Places a value every process holds whole onto the mesh."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec),
                                        lambda index: x[index])

  def place(self, x):
    """Inputs or targets `[B, M, D_local * b, ...]` (a pytree of such
    arrays) as mesh-wide arrays (each process passes its own replicas'
    slice)."""
    sharding = NamedSharding(self.mesh, self._window_spec)
    replicas = sorted({c // self.fsdp for c in self._local_columns()})

    def put(v):
      if isinstance(v, jax.Array) and v.sharding == sharding:
        return v
      if self.fsdp == 1:
        return jax.make_array_from_process_local_data(sharding, np.asarray(v))
      # A process may hold only some of a replica's members (an 'fsdp' axis
      # across processes): each device gets its columns of its replica.
      v = np.asarray(v)
      b = v.shape[2] // len(replicas)
      shape = v.shape[:2] + (self.num_replicas * b,) + v.shape[3:]
      arrays = []
      for device, index in sharding.addressable_devices_indices_map(
          shape).items():
        start, stop, _ = index[2].indices(shape[2])
        at = replicas.index(start // b) * b + start % b
        arrays.append(jax.device_put(v[:, :, at:at + stop - start], device))
      return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    return jax.tree.map(put, x)

  def _fetch(self, x) -> np.ndarray:
    """The whole of a mesh-wide array, on every process."""
    if isinstance(x, np.ndarray):
      return x
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def _per_device(self, tree, members: bool = False) -> tuple[Any, ...]:
    """Per-stage leaves `[S, ...]` in stage order (`members`: `[S, F, ...]`,
    each member's part), the same on every replica, as the state holds
    them: slot by slot, slot j's `[D, P, ...]` (sharded: `[D, P, F, ...]`)
    holding on device d stage `placement.stages[d, j]` (`state.py`)."""
    return self._put_slots([
        jax.tree.map(lambda v, j=j: np.asarray(v)[self.placement.stages[:, j]],
                     tree) for j in range(self.placement.num_slots)], members)

  def _put_slots(self, slots: Sequence[Any],
                 members: bool = False) -> tuple[Any, ...]:
    """Each slot's tree of `[P, ...]` leaves (`members`: `[P, F, ...]`) onto
    the mesh, the same on every replica: `[D, P, ...]`; on a sharded stage
    `[D, P, F, ...]`, a leaf without members the same on every member."""
    def put(v):
      v = np.asarray(v)
      if self._lead == 3 and not members:
        v = np.broadcast_to(v[:, None], (v.shape[0], self.fsdp) + v.shape[1:])
      return self._put(np.broadcast_to(v, (self.num_replicas,) + v.shape),
                       self._device_spec)

    return tuple(jax.tree.map(put, tree) for tree in slots)

  def _stage_rows(self, slots, field: Callable = lambda v: v) -> np.ndarray:
    """Replica rows `[D, S, ...]`, in stage order, of a per-stage field held
    slot by slot (`field` picks the leaf from each slot's tree)."""
    blocks = [self._fetch(field(tree)) for tree in slots]
    if self._lead == 3:  # every member holds these whole: member 0's
      blocks = [b[:, :, 0] for b in blocks]
    rows = np.empty(blocks[0].shape[:1] + (len(self.stage_fns),)
                    + blocks[0].shape[2:], blocks[0].dtype)
    for j, block in enumerate(blocks):
      rows[:, self.placement.stages[:, j]] = block
    return rows

  def state_bytes(self, stage_params: Sequence[Any]) -> dict[str, int]:
    """Bytes one device holds of the state's weights and their stashed
    versions (`weights`: every slot of its rings), optimizer state and
    gradient accumulator, the most over the devices, and their `total`:
    from the layouts alone (shapes; nothing is placed or initialised), so a
    run can be checked against a device's memory before it starts. On a
    sharded stage, a member's parts (`fsdp.py`)."""
    shapes = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.dtype(v.dtype)),
        tuple(stage_params))
    opt = jax.eval_shape(lambda p: scope_lib.init_states(
        self.optimizer, self.optimizer_scope, p, self.tied), shapes)
    if self.fsdp > 1:
      params = fsdp_lib.Shards(shapes, self.fsdp, self.fsdp_rule)
      shapes, opt = params.trees, fsdp_lib.Shards(
          opt, self.fsdp, self.fsdp_rule, like=params).trees
    row, opt_row = self.layout(shapes).row_bytes, self.layout(opt).row_bytes
    versions = self.program.pool_size or max(
        sum(self.program.ring_sizes[s] for s in stages)
        for stages in self.placement.stages)
    slots = self.placement.num_slots
    out = {"weights": versions * row, "optimizer": slots * opt_row,
           "accumulator": slots * row}
    return out | {"total": sum(out.values())}

  def init(self, stage_params: Sequence[Any],
           stage_states: Sequence[Any] | None = None) -> PipelineState:
    """Packs S stage pytrees (and their optimizer states) onto the mesh, with
    the stages' initial non-parameter states where they take one
    (`stage.py`; None for a stage without)."""
    if len(stage_params) != len(self.stage_fns):
      raise ValueError(f"{len(stage_params)} stage parameter trees do not fit "
                       f"{len(self.stage_fns)} stages; valid: "
                       f"{len(self.stage_fns)}")
    # On the host first: a module's arrays may carry their own sharding
    # (`nnx.with_partitioning` over another mesh), which packing must not see.
    stage_params, stage_states = jax.device_get((tuple(stage_params),
                                                 stage_states))
    states = stage_lib.initial_states(self._wants, stage_states)
    self._state_packing = (None if states is None
                           else packing.Packing(states))
    opt_states = scope_lib.init_states(self.optimizer, self.optimizer_scope,
                                       stage_params, self.tied)
    self._param_trees = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.dtype(v.dtype)),
        stage_params)
    if self.fsdp > 1:
      params, opt = self._init_sharded(stage_params, opt_states)
      init_sync = jax.vmap(jax.vmap(self.sync.init_state))
    else:
      self._param_packing = self.layout(stage_params)
      self._opt_packing = self.layout(opt_states)
      params = self._param_packing.pack_all(stage_params)
      opt = self._opt_packing.pack_all(opt_states)
      init_sync = jax.vmap(self.sync.init_state)
    members = self.fsdp > 1
    rings = ([pool_lib.initial(params, self.placement.stages,
                               self.program.pool_size)] if self.pooled
             else [self._initial_ring(params, stages)
                   for stages in self.placement.stages.T])
    return PipelineState(
        ring=self._put_slots(rings, members),
        opt_state=self._per_device(opt, members),
        grads=self._per_device(jax.tree.map(jnp.zeros_like, params), members),
        buffers=None, history=None,
        sync=self._per_device(init_sync(params), members),
        step=self._put(np.zeros((), np.int32), P()),
        stage_state=None if states is None else self._per_device(
            self._state_packing.pack_all(states)))

  def _init_sharded(self, stage_params, opt_states) -> tuple:
    """Cuts each stage's weights and optimizer state over 'fsdp'
    (`fsdp.Shards`): the packed parts `[S, F, L]` of both."""
    F = self.fsdp
    params = fsdp_lib.Shards(stage_params, F, self.fsdp_rule)
    opt = fsdp_lib.Shards(opt_states, F, self.fsdp_rule, like=params)
    elementwise = (self.optimizer_scope == "stage"
                   and fsdp_lib.elementwise(self.optimizer)
                   and all(packing.shares_structure(
                       jax.eval_shape(self.optimizer.init, part), whole)
                           for part, whole in zip(params.trees, opt.trees)))
    self._sharded = fsdp_lib.Sharded(params, opt, elementwise)
    self._param_packing = self.layout(params.trees)
    self._opt_packing = self.layout(opt.trees)

    def parts(shards, layout, trees):
      per_member = [layout.pack_all([shards.cut(s, t, i)
                                     for s, t in enumerate(trees)])
                    for i in range(F)]
      return {k: np.stack([np.asarray(m[k]) for m in per_member], axis=1)
              for k in per_member[0]}

    return (parts(params, self._param_packing, stage_params),
            parts(opt, self._opt_packing, opt_states))

  def _whole(self, s: int, flat: dict, opt: bool = False):
    """Stage s's whole tree from one position of a per-stage field (host
    arrays, `[F, ...]` per dtype where sharded): weights, or the optimizer
    state's (`opt`)."""
    layout = self._opt_packing if opt else self._param_packing
    if self._sharded is None:
      return layout.unpack(s, flat)
    shards = self._sharded.opt if opt else self._sharded.params
    return shards.merge_packed(s, layout, flat)

  def _held(self, s: int, tree, opt: bool = False) -> dict:
    """`_whole`'s inverse: stage s's tree as this pipeline holds it at one
    position (host arrays)."""
    layout = self._opt_packing if opt else self._param_packing
    if self._sharded is None:
      return {k: np.asarray(v) for k, v in layout.pack(s, tree).items()}
    shards = self._sharded.opt if opt else self._sharded.params
    rows = [layout.pack(s, shards.cut(s, tree, i)) for i in range(self.fsdp)]
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}

  def reshard(self, state: PipelineState, source: "Pipeline"
              ) -> PipelineState:
    """`state`, as `source` holds it, as this pipeline holds it: the same
    stages, schedule, rule and placement on another 'fsdp' size (1
    included), every weight version, accumulator and optimizer state merged
    from `source`'s parts and cut into this one's, activations in flight
    re-split over the members (`reshard.py`). Both pipelines must have been
    `init`ed (their layouts).

    Raises:
      ValueError: in one line, for pipelines that differ in more than the
        'fsdp' size, or a sync policy with a state of its own (WSP).
    """
    return reshard_lib.reshard(self, state, source)

  def _initial_ring(self, params, stages: np.ndarray) -> WeightRing:
    """The rings of `stages` (one slot's, one per device) with version 0 in
    ring slot 0 and the others empty, `[P, R, ...]` (R: the slot's ring
    size, `Program.ring_sizes`); sharded, `params` are `[S, F, L]` and the
    ring `[P, F, R, ...]`."""
    R = self.program.ring_sizes[stages[0]]
    lead = (len(stages),) + ((self.fsdp,) if self.fsdp > 1 else ())
    ring = {k: np.zeros(lead + (R,) + v.shape[len(lead):], v.dtype)
            for k, v in params.items()}
    for k, v in params.items():
      ring[k][(slice(None),) * len(lead) + (0,)] = np.asarray(v)[stages]
    versions = np.full(lead + (R,), -1, np.int32)
    versions[..., 0] = 0
    return WeightRing(ring, versions, np.zeros(lead, np.int32))

  def params(self, state: PipelineState, replica: int = 0) -> tuple[Any, ...]:
    """The latest weights of the S stages held by data replica `replica`."""
    rows = {}
    if self.pooled:
      pool = jax.tree.map(lambda v: self._fetch(v)[replica], state.ring[0])
      for (d, j), s in np.ndenumerate(self.placement.stages):
        at = pool_lib.latest_row(pool.versions[d], pool.owner[d],
                                 pool.latest[d], j)
        rows[int(s)] = {k: v[d, at] for k, v in pool.params.items()}
    for j, ring in enumerate(() if self.pooled else state.ring):
      versions, latest = (self._fetch(ring.versions)[replica],
                          self._fetch(ring.latest)[replica])
      flat = {k: self._fetch(v)[replica] for k, v in ring.params.items()}
      for d, s in enumerate(self.placement.stages[:, j]):
        if self._sharded is not None:  # member i's part of the version
          at = int(np.argmax(versions[d, 0] == latest[d, 0]))
          rows[int(s)] = self._whole(int(s), {k: v[d, :, at]
                                              for k, v in flat.items()})
          continue
        at = int(np.argmax(versions[d] == latest[d]))
        rows[int(s)] = {k: v[d, at] for k, v in flat.items()}
    if self._sharded is not None:
      return tuple(jax.tree.map(np.asarray, rows[s])
                   for s in range(len(self.stage_fns)))
    return self._param_packing.unpack_all(
        {k: np.stack([rows[s][k] for s in range(len(self.stage_fns))])
         for k in rows[0]})

  def updates_applied(self, state: PipelineState) -> np.ndarray:
    """The updates each stage has applied, `[D, S]` (replicas, stages in
    stage order), on every process."""
    if self.pooled:
      latest = self._fetch(state.ring[0].latest)
      return self._stage_rows([latest[..., j] for j in
                               range(self.placement.num_slots)])
    return self._stage_rows(state.ring, lambda r: r.latest)

  def stage_states(self, state: PipelineState,
                   replica: int = 0) -> tuple[Any, ...] | None:
    """The S stages' non-parameter states on data replica `replica` (None
    for a stage without; None if no stage has one)."""
    if state.stage_state is None:
      return None
    flat = {k: self._stage_rows(state.stage_state, lambda t, k=k: t[k])[
        replica] for k in state.stage_state[0]}
    return stage_lib.given_states(self._wants,
                                  self._state_packing.unpack_all(flat))

  def abstract_state(self, stage_params: Sequence[Any], inputs,
                     targets) -> PipelineState:
    """The state's structure after a step, without running one.

    Shapes, dtypes and shardings of every leaf (`jax.ShapeDtypeStruct`), e.g.
    to restore a checkpoint into; `inputs` and `targets` are laid out as for
    `step` (only their shapes matter). It places a zero state on the devices
    to read the shardings from, so it briefly takes a state's memory.
    """
    state = self._allocate(self.init(stage_params), self.place(inputs),
                           self.place(targets))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state)

  def _check_window(self, inputs, targets):
    if self._param_packing is None:
      raise ValueError("step() before init(); valid: state = pipe.init("
                       "stage_params), then pipe.step(state, ...)")
    B, M = self.schedule.num_minibatches, self.schedule.num_microbatches
    local_replicas = len({c // self.fsdp for c in self._local_columns()})
    for name, tree in (("inputs", inputs), ("targets", targets)):
      shapes = [np.shape(v) for v in jax.tree.leaves(tree)]
      for shape in shapes:
        if (len(shape) < 3 or shape[:2] != (B, M)
            or shape[2] % local_replicas or shape[2] != shapes[0][2]):
          raise ValueError(
              f"{name} shape {shape} is invalid; valid: [{B}, {M}, a "
              f"multiple of {local_replicas} data replicas (the same for "
              "every leaf), ...]")

  def _local_columns(self) -> list[int]:
    """The micro-batch columns (data replica, and member on 'fsdp') whose
    devices this process holds."""
    devices = self.mesh.devices.reshape(self.num_replicas, -1, self.fsdp)
    return [r * self.fsdp + f for r in range(self.num_replicas)
            for f in range(self.fsdp)
            if any(d.process_index == jax.process_index()
                   for d in devices[r, :, f])]

  def arguments(self, state: PipelineState, inputs, targets) -> tuple:
    """The window step's arguments, placed on the mesh: `(state, inputs,
    targets, tables, plan)`, for the function `lower` and `compile` give
    (e.g. `pipe.compile(state, x, y)(*pipe.arguments(state, x, y))`, which
    donates the state like `step`)."""
    contract.refuse_drained(state.drained is not None)
    self._check_window(inputs, targets)
    inputs, targets = self.place(inputs), self.place(targets)
    if state.buffers is not None and self._buffer_shapes(
        inputs, targets) != jax.tree.map(np.shape, state.buffers):
      self._refuse_new_shapes(state, inputs, targets)
      state = state._replace(buffers=None)  # nothing in flight: new shapes
    if state.buffers is None:
      state = self._allocate(state, inputs, targets)
    if self._tables is None:
      self._tables = jax.tree.map(lambda c: self._put(c, P()),
                                  self.program.tables)
    return state, inputs, targets, self._tables, self._sync_plan(state)

  def _refuse_new_shapes(self, state: PipelineState, inputs, targets):
    """Refuses a window shaped unlike the windows whose work is in flight
    (an asynchronous schedule's activations and kept inputs)."""
    if self.program.history == 0 or state.history is None:
      return
    B = self.schedule.num_minibatches
    for name, kept, now in (("inputs", state.history.inputs, inputs),
                            ("targets", state.history.targets, targets)):
      for k, n in zip(jax.tree.leaves(kept), jax.tree.leaves(now)):
        if k.shape[1:] != n.shape[1:] or k.dtype != n.dtype:
          raise ValueError(
              f"{name} shape {n.shape} is not the shape {(B,) + k.shape[1:]} "
              f"this run was built for; valid: {(B,) + k.shape[1:]} (schedule "
              f"{self.schedule.name!r} carries work of earlier windows in "
              "flight; a flush schedule takes new shapes between steps)")
    raise ValueError("inputs and targets need activation buffers unlike the "
                     "state's; valid: the shapes of the earlier windows")

  def _shape_key(self, inputs, targets) -> tuple:
    return jax.tree.structure((inputs, targets)), tuple(
        (v.shape, v.dtype) for v in jax.tree.leaves((inputs, targets)))

  def _step_fn(self, inputs, targets) -> Callable:
    key = self._shape_key(inputs, targets)
    if key not in self._steps:
      self._steps[key] = self._build_step(inputs, targets)
    return self._steps[key]

  def step(self, state: PipelineState, inputs, targets):
    """Runs one window of the schedule.

    Args:
      state: from `init` or a previous `step`.
      inputs: `[B, M, D * b, ...]`: B minibatches of M micro-batches; the
        micro-batch axis is split over the D data replicas (b examples each).
        In a multi-process run, each process passes its own slice
        `[B, M, D_local * b, ...]` for the replicas on its devices.
      targets: `[B, M, D * b, ...]`, laid out like `inputs`.

    Returns:
      The new state and metrics: `loss`, the mean loss of the micro-batches
      whose forward reached the last stage in this window (NaN if none did),
      and `num_losses`, their count; `seconds`, the window's wall time
      (the call until its results are ready; the first call includes
      compiling), `examples_per_s` (the window's B*M*D*b examples over it),
      and for sequence targets (`[B, M, D*b, L, ...]`) `tokens_per_s` (the
      first target leaf's elements over it).
    """
    start = time.perf_counter()
    args = self.arguments(state, inputs, targets)
    state, metrics = self._step_fn(args[1], args[2])(*args)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    return state, {**metrics, **throughput(args[1], args[2], seconds)}

  def drain(self, state: PipelineState):
    """Finishes the minibatches still in flight at the end of a run: the H
    windows after the last one, with every task and update of a minibatch
    that would start in them left out (`program.drain_table`), so the
    weights hold every minibatch trained on (an asynchronous schedule's
    last ones included). The state is then for `params`, `evaluate` and
    checkpoints; `step` and `drain` refuse it (it is marked drained).

    Returns:
      The state and `loss` / `num_losses` of the forwards the drain ran.
    """
    contract.refuse_drained(state.drained is not None)
    H, B = self.program.history, self.schedule.num_minibatches
    drained = self._put(np.ones((), bool), P())
    if H == 0 or state.history is None:  # nothing crosses a window
      return state._replace(drained=drained), {"loss": jnp.nan,
                                               "num_losses": 0}
    zeros = lambda tree: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
        lambda h: self._put(np.zeros((B,) + h.shape[1:], h.dtype),
                            self._window_spec),
        tree)
    inputs, targets = zeros(state.history.inputs), zeros(state.history.targets)
    total, count = 0.0, 0
    window = int(self._fetch(state.step))
    drains = [program_lib.drain_table(self.program, window + j, (H - j) * B)
              for j in range(H)]
    if self.pooled:  # the rows its updates overwrite, from the pool as it is
      drains = pool_lib.replan(drains, jax.tree.map(
          lambda v: self._fetch(v)[0], state.ring[0]), self.placement.stages)
    for j in range(H):
      state, inputs, targets, _, plan = self.arguments(state, inputs, targets)
      tables = jax.tree.map(lambda c: self._put(c, P()), drains[j])
      state, metrics = self._step_fn(inputs, targets)(state, inputs, targets,
                                                      tables, plan)
      n = int(metrics["num_losses"])
      total, count = total + (float(metrics["loss"]) * n if n else 0.0), count + n
    return state._replace(drained=drained), {
        "loss": total / count if count else jnp.nan, "num_losses": count}

  def evaluate(self, state: PipelineState, inputs, targets) -> dict:
    """A forward-only window (`forward_only.py`): every micro-batch through
    the stages' latest weights with `train=False`; no backward, no update,
    the state unchanged.

    Args:
      state: from `init` or `step`.
      inputs, targets: laid out as for `step`, `[B, M, D * b, ...]`.

    Returns:
      `loss`, the mean of `loss_fn` over the window's micro-batches (no
      auxiliary terms), and `outputs`, the last stage's outputs `[B, M,
      D * b, ...]` (e.g. logits).
    """
    self._check_window(inputs, targets)
    inputs, targets = self.place(inputs), self.place(targets)
    key = ("evaluate",) + self._shape_key(inputs, targets)
    if key not in self._steps:
      self._steps[key] = self._build_evaluate(inputs, targets)
    metrics, outputs = self._steps[key](state, inputs, targets)
    B, M = self.schedule.num_minibatches, self.schedule.num_microbatches
    return {**metrics, "outputs": jax.tree.map(
        lambda o: o.reshape((B, M) + o.shape[1:]), outputs)}

  def _build_evaluate(self, inputs, targets) -> Callable:
    """The jitted forward-only window for windows shaped like these."""
    fns = tuple(stage_lib.bind(f, train=False, first=s == 0)
                for s, f in enumerate(self.stage_fns))
    micro = lambda v: jax.ShapeDtypeStruct(  # pylint: disable=unnecessary-lambda-assignment
        (v.shape[2] // self._columns,) + v.shape[3:], v.dtype)
    stage_inputs = [jax.tree.map(micro, inputs)]
    for s, params in enumerate(self._param_trees):
      out = jax.eval_shape(fns[s], params,
                           self._bound_input(s, stage_inputs[-1]))
      stage_inputs.append(out)
    target = jax.tree.map(micro, targets)
    objective = jax.eval_shape(
        lambda y, t: stage_lib.evaluation_objective(self.loss_fn, y, t),
        stage_inputs[-1], target)
    ctx = forward_only.Forward(
        fns=fns, loss_fn=self.loss_fn, params=self._param_packing,
        boundaries=boundary_lib.analyse(stage_inputs[:-1]),
        output=stage_inputs[-1][0], wants=self._wants,
        states=self._state_packing, objective=objective,
        seed=self.seed, num_microbatches=self.schedule.num_microbatches,
        placement=self.placement, sharded=self._sharded)

    @jax.jit
    def evaluate_fn(state, inputs, targets):
      return jax.shard_map(
          functools.partial(forward_only.run, ctx), mesh=self.mesh,
          in_specs=(self._state_specs(state),
                    jax.tree.map(lambda _: self._window_spec, inputs),
                    jax.tree.map(lambda _: self._window_spec, targets)),
          out_specs=(jax.tree.map(lambda _: P(), ctx.objective[1]) | {
              "loss": P()}, jax.tree.map(
                  lambda _: P(None, self._window_spec[2]), ctx.output)),
          check_vma=False)(state, inputs, targets)

    return evaluate_fn

  def _state_specs(self, state: PipelineState) -> PipelineState:
    return state_specs(state, self._device_spec, self._window_spec)

  def lower(self, state: PipelineState, inputs, targets) -> jax.stages.Lowered:
    """The window step for these arguments, lowered (e.g. for its HLO)."""
    args = self.arguments(state, inputs, targets)
    return self._step_fn(args[1], args[2]).lower(*args)

  def compile(self, state: PipelineState, inputs,
              targets) -> jax.stages.Compiled:
    """The window step compiled (e.g. for its memory analysis)."""
    return self.lower(state, inputs, targets).compile()

  def _sync_plan(self, state: PipelineState) -> dict[str, jax.Array]:
    """The sync policy's plan for the updates this window can hold."""
    B, H = self.schedule.num_minibatches, self.program.history
    if self.sync.plan_is_static and self._static_plan is not None:
      return self._static_plan
    window = 0 if self.sync.plan_is_static else int(jax.device_get(state.step))
    plan = self.sync.plan((window - H) * B, (H + 1) * B, len(self.stage_fns))
    plan = {k: self._put(v, P()) for k, v in plan.items()}
    if self.sync.plan_is_static:
      self._static_plan = plan
    return plan

  def _stages(self, inputs, targets) -> tick_lib.Stages:
    """What the tick functions know statically, for windows of this shape."""
    micro = lambda tree: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
        lambda v: jax.ShapeDtypeStruct(
            (v.shape[2] // self._columns,) + v.shape[3:], v.dtype), tree)
    stage_inputs = [micro(inputs)]
    for s, params in enumerate(self._param_trees[:-1]):
      stage_inputs.append(jax.eval_shape(
          self._fns[s], params, self._bound_input(s, stage_inputs[-1])))
    bound_inputs = [self._bound_input(s, x) for s, x in enumerate(stage_inputs)]
    target = micro(targets)
    for s, fn in enumerate(self._state_fns):
      if fn is not None:
        stage_lib.check_state(self._fns[s], fn, self._param_trees[s],
                              bound_inputs[s], s)
    objective = jax.eval_shape(
        lambda p, x, t: self._loss_fn(self._fns[-1](p, x), t),
        self._param_trees[-1], bound_inputs[-1], target)
    split, forwards = self._forwards(bound_inputs, target)
    layout = None
    if self.remat == "residuals":
      layout = residuals_lib.analyse(forwards, self._param_trees,
                                     bound_inputs, target)
    return tick_lib.Stages(
        fns=self._fns, state_fns=self._state_fns, loss_fn=self._loss_fn, params=self._param_packing,
        opt=self._opt_packing, optimizer=self.optimizer, sync=self.sync,
        program=self.program,
        boundaries=boundary_lib.analyse(stage_inputs),
        num_microbatches=self.schedule.num_microbatches,
        window_minibatches=self.schedule.num_minibatches,
        lowering=self.lowering, residuals=layout, forwards=forwards,
        split=split, stale_schedule=self._stale_schedule,
        wants=self._wants, seed=self.seed,
        whole_model=self.optimizer_scope == "model",
        states=self._state_packing, objective=objective,
        placement=self.placement, tied=self.tied, sharded=self._sharded,
        gather_once=self.fsdp_gather == "window", lanes=self._lanes)

  def _bound_input(self, s: int, x):
    """Stage s's input `x` (shapes) as its bound function takes it
    (`stage.bind`): with a key's and its state's shapes where the stage
    wants them."""
    state = (None if self._state_packing is None
             else self._state_packing.trees[s])
    return stage_lib.extras_struct(x, self._wants[s], state)

  def _forwards(self, stage_inputs, target) -> tuple:
    """The split backward's layout (None unless remat="residuals" on a
    schedule with input- and weight-gradient tasks) and what each stage's
    forward runs under remat="residuals" (`residuals.analyse`)."""
    last = len(self.stage_fns) - 1
    vjps = tuple(residuals_lib.vjp(fn, self._loss_fn, s == last)
                 for s, fn in enumerate(self._fns))
    if self.remat != "residuals" or not any(
        kinds_lib.kind(k).splits_backward for k in self.program.kinds):
      return None, vjps
    objectives = [lambda p, x, t, s=s: residuals_lib.objective(
        self._fns[s], self._loss_fn, s == last, t)(p, x)
                  for s in range(len(self.stage_fns))]
    split = split_lib.analyse_all(objectives, self._param_trees,
                                  stage_inputs, target)
    return split, tuple(functools.partial(split_lib.forward, stage)
                        for stage in split.stages)

  def _context(self, inputs, targets) -> tick_lib.Stages:
    """`_stages` for windows of this shape, computed once."""
    key = self._shape_key(inputs, targets)
    if key not in self._contexts:
      self._contexts[key] = self._stages(inputs, targets)
    return self._contexts[key]

  def _buffer_shapes(self, inputs, targets) -> tuple[Buffers, ...]:
    """Each slot's activation buffers' shapes (dtype -> shape) for windows
    of this shape."""
    ctx = self._context(inputs, targets)
    D, P, C = (self.num_replicas, self.placement.num_devices,
               self.program.num_slots)
    F = (self.fsdp,) if self._lead == 3 else ()
    rows = lambda lengths: {k: (D, P) + F + (C + 1, n)  # pylint: disable=unnecessary-lambda-assignment
                            for k, n in lengths.items()}  # + scratch
    kept = lambda layout: {} if layout is None else rows(layout.packing.lengths)  # pylint: disable=unnecessary-lambda-assignment
    return tuple(Buffers(rows(ctx.boundaries.acts.lengths),
                         rows(ctx.boundaries.cots.lengths),
                         kept(ctx.residuals), kept(ctx.split))
                 for _ in range(self.placement.num_slots))

  def _allocate(self, state, inputs, targets) -> PipelineState:
    """Zero activation buffers and input history, on first use."""
    H, B = self.program.history, self.schedule.num_minibatches
    past = lambda tree: None if H == 0 else jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
        lambda x: self._put(np.zeros((H * B,) + x.shape[1:], x.dtype),
                            self._window_spec), tree)
    return state._replace(
        buffers=tuple(Buffers(*[
            {k: self._put(np.zeros(shape, k), self._device_spec)
             for k, shape in field.items()} for field in slot])
                      for slot in self._buffer_shapes(inputs, targets)),
        history=InputHistory(past(inputs), past(targets)))

  def _build_step(self, inputs, targets) -> Callable:
    """The jitted window step for windows shaped like these."""
    ctx = self._context(inputs, targets)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step_fn(state, inputs, targets, tables, plan):
      mapped = jax.shard_map(
          functools.partial(run_window, ctx), mesh=self.mesh,
          in_specs=(self._state_specs(state),
                    jax.tree.map(lambda _: self._window_spec, inputs),
                    jax.tree.map(lambda _: self._window_spec, targets),
                    jax.tree.map(lambda _: P(), tables),
                    jax.tree.map(lambda _: P(), plan)),
          out_specs=(self._state_specs(state), P()), check_vma=False)
      return mapped(state, inputs, targets, tables, plan)

    return step_fn

