"""The lanes' tick: a device runs its active slots only, not all of them.

In a device-level schedule (interleaved 1F1B, looped BFS, ZB-V, DualPipeV,
their asynchronous versions; `schedules/placement.py`) a device runs at most
one task a tick (DualPipeV: an overlapped F&B pair, two), whichever of its
v chunks the schedule names. The slots' tick (`tick.tick`) pays every slot's
conditionals, filing and outbox in every tick, so its cost grows with v.
Here a device runs L lanes a tick, L the most slots any device has busy in
one tick of the tables (a task or an update: `plan`), each lane the slot the
table names (`Stages.lanes`), on the device's slots held as one array:

- the slots' per-stage fields stacked, `[v, ...]` (their ring rows
  concatenated, `[sum_j R_j, L]`), read and written at the lane's slot by a
  dynamic index: a tick touches one slot's rows, whatever v;
- a lane's task is dispatched over every stage (`Window.choice` = its
  stage): one conditional a lane, not one a slot;
- what a lane sent travels once per device offset along 'stage' that the
  placement's hops use (loop: +1; V: +1 and -1; within the device: none),
  every tick and outside any conditional (the persistent-cache rule of
  `tick.hop`), tagged with the sending stage; the receiver files it in the
  slot that holds that stage's successor (or predecessor), at the buffer
  slot its row of last tick names, or in a scratch row.

The plan is read from the program's tables; a step given other tables
must leave tasks out of them, never add any (the drain's do,
`program.drain_table`): a slot the plan does not run would not run.
The numerics are the slots' tick's: the same tasks, versions and updates in
the same order on each slot, every lane's task before any lane's update
(tested bit for bit against it, `tests/lanes_test.py`). On a pooled stash
(`pool.py`) the pool is the slots' stacked ring, each lane's view finding
its slot's rows by tag. Not for a stage sharded over 'fsdp' or an optimizer
stepping on the whole model (`scope.py`): `check` says so in one line.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import pool as pool_lib
from stalepipe.pipeline import program as program_lib
from stalepipe.pipeline import tick as tick_lib
from stalepipe.pipeline.state import TickCarry, WeightRing

TICKS = ("auto", "slots", "lanes")
AUTO_RATIO = 16  # slots a lane from which "auto" runs the lanes' tick


class LaneCarry(NamedTuple):
  """One device's view inside the lanes' tick loop."""

  slots: TickCarry  # every per-slot field stacked over the device's v
  #   slots (`stack`): the buffers as rows `[v(C+1), ...]`, the rings'
  #   rows concatenated; the loss sums once a device; `outbox` None
  outboxes: tuple  # per lane, its `tick.Outbox`: what its task sent last tick
  senders: jax.Array  # int32 [L]: 1 + the stage each lane's task ran last
  #   tick; 0: none


def plan(program: program_lib.Program, stages: np.ndarray) -> np.ndarray:
  """The slot each lane of each device runs, per window table and tick:
  int32 `[K, T, P, L]`, -1 for a lane with nothing to run. A slot is busy
  in a tick where its stage has a task or an update; L is the most slots
  busy on one device in one tick.

  Examples:
    >>> import stalepipe as sp
    >>> s = sp.schedules.make("interleaved-1f1b", num_stages=4,
    ...                       num_microbatches=4, num_devices=2)
    >>> p = program_lib.compile_program(s)
    >>> plan(p, sp.pipeline.placement.for_schedule(s, 2).stages).shape[-1]
    1
  """
  tables = program.tables
  busy = ((tables.kind != program_lib.IDLE) | (tables.update == 1))[
      ..., stages]  # [K, T, P, v]
  width = max(int(busy.sum(-1).max()), 1)
  order = np.argsort(~busy, axis=-1, kind="stable")[..., :width]
  count = busy.sum(-1, keepdims=True)
  return np.where(np.arange(width) < count, order, -1).astype(np.int32)


def check(tick: str, num_slots: int, sharded: bool, whole_model: bool,
          lanes: np.ndarray) -> bool:
  """Whether the lanes' tick runs (`tick`: "auto", "slots" or "lanes");
  "lanes" where it cannot is refused in one line. "auto" takes it where a
  device has at least `AUTO_RATIO` times more slots than lanes: on the CPU
  the lanes' tick costs more than the slots' at 2-8 chunks a lane and less
  at 16 (docs/executor.md, "Folding")."""
  if tick not in TICKS:
    raise ValueError(f"tick {tick!r} is invalid; valid: {', '.join(TICKS)}")
  reason = ("one slot a device" if num_slots == 1 else
            "a stage sharded over 'fsdp'" if sharded else
            "optimizer_scope 'model'" if whole_model else None)
  if tick == "lanes" and reason:
    raise ValueError(f"tick 'lanes' is invalid with {reason}; valid: "
                     "tick 'slots' or 'auto'")
  if tick == "auto":
    return reason is None and num_slots >= AUTO_RATIO * lanes.shape[-1]
  return tick == "lanes"


def _owner(ctx: tick_lib.Stages) -> np.ndarray:
  """The slot each row of the concatenated rings belongs to."""
  sizes = [ctx.program.ring_sizes[s] for s in ctx.placement.stages[0]]
  return np.repeat(np.arange(len(sizes)), sizes)


def stack(ctx: tick_lib.Stages, carries: tuple) -> LaneCarry:
  """The slots' carries as one (`LaneCarry.slots`)."""
  stacked = lambda *v: jnp.stack(v)  # pylint: disable=unnecessary-lambda-assignment
  joined = lambda *v: jnp.concatenate(v)  # pylint: disable=unnecessary-lambda-assignment
  rings = [c.ring for c in carries]
  first = carries[0]
  slots = first._replace(
      ring=rings[0] if isinstance(rings[0], pool_lib.StashPool) else
      WeightRing(jax.tree.map(joined, *[r.params for r in rings]),
                 joined(*[r.versions for r in rings]),
                 stacked(*[r.latest for r in rings])),
      opt_state=jax.tree.map(stacked, *[c.opt_state for c in carries]),
      grads=jax.tree.map(stacked, *[c.grads for c in carries]),
      grads_spent=stacked(*[c.grads_spent for c in carries]),
      buffers=_rows(ctx, jax.tree.map(stacked, *[c.buffers
                                                  for c in carries])),
      sync=jax.tree.map(stacked, *[c.sync for c in carries]),
      stage_state=jax.tree.map(stacked, *[c.stage_state for c in carries]),
      outbox=None)
  width = ctx.lanes.shape[-1]
  return LaneCarry(slots, tuple(tick_lib.empty_outbox(ctx)
                                for _ in range(width)),
                   jnp.zeros(width, jnp.int32))


def unstack(ctx: tick_lib.Stages, carry: LaneCarry) -> tuple:
  """`stack`'s inverse: the slots' carries (the loss sums on slot 0)."""
  s, owner = carry.slots, _owner(ctx)
  buffers = _rows(ctx, s.buffers, back=True)
  zero = lambda v: jnp.zeros_like(v)  # pylint: disable=unnecessary-lambda-assignment
  out = []
  for j in range(ctx.placement.num_slots):
    rows = np.flatnonzero(owner == j)
    at = lambda v, j=j: v[j]  # pylint: disable=unnecessary-lambda-assignment
    if isinstance(s.ring, pool_lib.StashPool):  # the pool, on slot 0
      ring = s.ring if j == 0 else None
    else:
      ring = WeightRing(jax.tree.map(lambda v, r=rows: v[r[0]:r[-1] + 1],
                                     s.ring.params),
                        s.ring.versions[rows[0]:rows[-1] + 1],
                        s.ring.latest[j])
    losses = {} if j == 0 else dict(
        loss_sum=zero(s.loss_sum), num_losses=zero(s.num_losses),
        metric_sums=jax.tree.map(zero, s.metric_sums))
    out.append(s._replace(
        ring=ring, opt_state=jax.tree.map(at, s.opt_state),
        grads=jax.tree.map(at, s.grads), grads_spent=s.grads_spent[j],
        buffers=jax.tree.map(at, buffers), sync=jax.tree.map(at, s.sync),
        stage_state=jax.tree.map(at, s.stage_state), outbox=None, **losses))
  return tuple(out)


def _rows(ctx: tick_lib.Stages, buffers, back: bool = False):
  """The stacked buffers `[v, C+1, ...]` as rows `[v(C+1), ...]` (or back)."""
  v = ctx.placement.num_slots
  shape = lambda x: ((v, -1) if back else (-1,)) + x.shape[(1 if back  # pylint: disable=unnecessary-lambda-assignment
                                                            else 2):]
  return jax.tree.map(lambda x: x.reshape(shape(x)), buffers)


def view(ctx: tick_lib.Stages, carry: LaneCarry, a, lane: int,
         task: bool = False) -> TickCarry:
  """Slot `a`'s carry as the tick functions read it: its own opt state,
  accumulator and state by index; its ring as the concatenated rings with
  the other slots' versions hidden (-2); the buffers as rows (a task finds
  its slot's by `Window.lane`). For a `task`, the accumulators stay
  stacked, `[v, L]`: the task adds to row a in place (`tick.stacked_sum`)."""
  s = carry.slots
  at = lambda v: v[a]  # pylint: disable=unnecessary-lambda-assignment
  grads = (s.grads, s.grads_spent) if task else (
      jax.tree.map(at, s.grads), s.grads_spent[a])
  if isinstance(s.ring, pool_lib.StashPool):
    ring = pool_lib.PoolView(s.ring.params, s.ring.versions, s.ring.owner,
                             s.ring.latest[a], a)
  else:
    ring = WeightRing(s.ring.params, jnp.where(
        jnp.asarray(_owner(ctx)) == a, s.ring.versions, -2), s.ring.latest[a])
  return s._replace(
      ring=ring,
      opt_state=jax.tree.map(at, s.opt_state),
      grads=grads[0], grads_spent=grads[1],
      buffers=s.buffers, sync=jax.tree.map(at, s.sync),
      stage_state=jax.tree.map(at, s.stage_state),
      outbox=carry.outboxes[lane])


def _put(stacked, a, value):
  return jax.tree.map(lambda v, n: tick_lib.put_row(v, a, n), stacked, value)


def after_task(ctx: tick_lib.Stages, carry: LaneCarry, a, lane: int,
               done: TickCarry, sender) -> LaneCarry:
  """`carry` with what slot `a`'s task changed (`done`, a task's `view`):
  the accumulators, its state, the buffers and the loss sums, and lane
  `lane`'s outbox."""
  s = carry.slots._replace(
      grads=done.grads, grads_spent=done.grads_spent, buffers=done.buffers,
      stage_state=_put(carry.slots.stage_state, a, done.stage_state),
      loss_sum=done.loss_sum, num_losses=done.num_losses,
      metric_sums=done.metric_sums)
  outboxes = list(carry.outboxes)
  outboxes[lane] = done.outbox
  return LaneCarry(s, tuple(outboxes), carry.senders.at[lane].set(sender))


def after_update(ctx: tick_lib.Stages, carry: LaneCarry, a,
                 done: TickCarry) -> LaneCarry:
  """`carry` with what slot `a`'s update changed (`done`, a `view`): its
  ring rows, latest version, optimizer and sync states."""
  s = carry.slots
  if isinstance(s.ring, pool_lib.StashPool):  # stored by `run_update`
    ring = s.ring
  else:
    mine = jnp.asarray(_owner(ctx)) == a
    ring = WeightRing(done.ring.params,
                      jnp.where(mine, done.ring.versions, s.ring.versions),
                      s.ring.latest.at[a].set(done.ring.latest))
  return carry._replace(slots=s._replace(
      ring=ring, opt_state=_put(s.opt_state, a, done.opt_state),
      grads_spent=s.grads_spent.at[a].set(done.grads_spent),
      sync=_put(s.sync, a, done.sync)))


def offsets(ctx: tick_lib.Stages, step: int) -> dict[int, list]:
  """Device offset along 'stage' -> the (sender, receiver) pairs of the
  placement's hops to stage s + `step` at that offset (0: in the device)."""
  P, groups = ctx.placement.num_devices, {}
  for h in ctx.placement.hops(step):
    for d, e, _ in h.pairs:
      groups.setdefault((e - d) % P, set()).add((d, e))
  return {o: sorted(pairs) for o, pairs in sorted(groups.items())}


def _file(ctx: tick_lib.Stages, buffers, rows, sender, previous,
          window: tick_lib.Window, field: str, step: int, places):
  """`buffers` (rows) with `rows`, sent by stage `sender - 1`, filed where
  its receiver (stage sender - 1 + step) holds it on this device, or in a
  scratch row where no stage here receives it (`places`: each stage's
  device and slot)."""
  S, C = ctx.num_stages, ctx.program.num_slots
  device_of, slot_of = places
  dest = jnp.clip(sender - 1 + step, 0, S - 1)
  expected = getattr(previous, "recv_" + field)[dest]
  ok = ((sender > 0) & (sender - 1 + step >= 0) & (sender - 1 + step < S)
        & (device_of[dest] == window.device) & (expected >= 0))
  name = "acts" if field == "forward" else "cots"
  target = getattr(buffers, name)
  if field == "forward":
    rows = {k: v[None] for k, v in rows.items()}
  for w in range(ctx.program.backward_width if field == "backward" else 1):
    row = jnp.where(ok, slot_of[dest] * (C + 1) + (expected + window.base + w)
                    % C, C)
    target = {k: tick_lib.put_row(v, row, rows[k][w])
              for k, v in target.items()}
  return buffers._replace(**{name: target})


def receive(ctx: tick_lib.Stages, carry: LaneCarry, previous,
            window: tick_lib.Window) -> LaneCarry:
  """Every lane's last outbox moved along each offset its hops use (one
  `ppermute` an offset, every tick) and filed by its receiver (`_file`)."""
  buffers = carry.slots.buffers
  where = np.argsort(ctx.placement.stages.ravel())  # stage -> d * v + j
  places = tuple(jnp.asarray(f(where, ctx.placement.num_slots))
                 for f in (np.floor_divide, np.mod))
  for field, step in (("forward", 1), ("backward", -1)):
    for offset, pairs in offsets(ctx, step).items():
      for lane, box in enumerate(carry.outboxes):
        moved = (getattr(box, field), carry.senders[lane])
        if offset:
          moved = jax.lax.ppermute(moved, tick_lib.STAGE, pairs)
        buffers = _file(ctx, buffers, *moved, previous, window, field, step,
                        places)
  return carry._replace(slots=carry.slots._replace(buffers=buffers))


def _lane_row(ctx: tick_lib.Stages, window: tick_lib.Window, rows, slot):
  """Slot `slot`'s stage, its row of the tick (blank where `slot` is -1: a
  lane with nothing to run) and its window."""
  a = jnp.maximum(slot, 0)
  stage = jnp.asarray(ctx.placement.stages)[window.device, a]
  instr = type(rows)(*[
      jnp.where(slot >= 0, column[stage], program_lib.blank(name))
      for name, column in zip(type(rows)._fields, rows)])
  return a, instr, window._replace(
      stage=stage, candidates=tuple(range(ctx.num_stages)), choice=stage,
      lane=a)


def run_task(ctx: tick_lib.Stages, window: tick_lib.Window, carry: LaneCarry,
             rows, slot, lane: int) -> LaneCarry:
  """Lane `lane` runs slot `slot`'s task (-1: nothing)."""
  a, instr, w = _lane_row(ctx, window, rows, slot)
  done = tick_lib.run_slot(ctx, view(ctx, carry, a, lane, task=True), instr,
                           w)
  sender = jnp.where(instr.kind != program_lib.IDLE, w.stage + 1, 0)
  return after_task(ctx, carry, a, lane, done, sender)


def run_update(ctx: tick_lib.Stages, window: tick_lib.Window,
               carry: LaneCarry, rows, slot, lane: int, after) -> LaneCarry:
  """Lane `lane` applies slot `slot`'s update, if its row names one. On a
  pooled stash (`pool.py`) the pool is only read under the conditional and
  the new version stored after it (`pool.claim`; `after`: True, from every
  lane's task)."""
  a, instr, w = _lane_row(ctx, window, rows, slot)

  def update(c):
    slot_view = view(ctx, c, a, lane)
    done = tick_lib.apply_update(
        ctx, w, slot_view, instr, tick_lib.reduced_gradient(ctx, slot_view),
        functools.partial(tick_lib.optimizer_step, ctx))
    return after_update(ctx, c, a, done), done.ring

  pool = carry.slots.ring
  if not isinstance(pool, pool_lib.StashPool):
    return jax.lax.cond(instr.update == 1, lambda c: update(c)[0],
                        lambda c: c, carry)
  mine = view(ctx, carry, a, lane).ring
  with_ring = lambda c, ring: c._replace(slots=c.slots._replace(ring=ring))  # pylint: disable=unnecessary-lambda-assignment

  def pooled(c):  # the pool read under the conditional, not passed out
    c, new = update(with_ring(c, pool))
    return with_ring(c, None), new

  carry, new = jax.lax.cond(instr.update == 1, pooled,
                            lambda c: (c, pool_lib.no_write(mine)),
                            with_ring(carry, None))
  claimed = pool_lib.claim(mine, new, after)
  return carry._replace(slots=carry.slots._replace(ring=pool._replace(
      params=claimed.params, versions=claimed.versions, owner=claimed.owner,
      latest=pool.latest.at[a].set(claimed.latest))))


def tick(ctx: tick_lib.Stages, window: tick_lib.Window, carry: LaneCarry, xs
         ) -> tuple[LaneCarry, Any]:
  """One tick on this device: file what arrived, then each lane's slot
  (`xs`: every stage's row of this tick and of the last, and the lanes'
  slots `[P, L]`)."""
  rows, previous, slots = xs
  carry = receive(ctx, carry, previous, window)
  lanes = range(slots.shape[-1])
  for lane in lanes:
    carry = run_task(ctx, window, carry, rows, slots[window.device, lane],
                     lane)
  after = carry.slots.num_losses >= 0  # True (`run_update`)
  for lane in lanes:  # every task's reads first, as in the slots' tick
    carry = run_update(ctx, window, carry, rows, slots[window.device, lane],
                       lane, after)
  return carry, None
