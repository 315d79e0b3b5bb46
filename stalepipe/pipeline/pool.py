"""A device's weight versions in one pooled stash, shared by its slots.

With one ring a slot (`state.WeightRing`), a folded or device-level
pipeline holds, on every device, the most versions each of its slots ever
needs, summed: one SPMD shape makes each slot's ring as deep as its
deepest stage on any device. The versions a device's stages keep at once
can be fewer: on asynchronous PipeDream's V placement a device's early
chunk keeps many versions while its late chunk keeps few, and the sum of
what its slots keep at any tick is the schedule's per-device figure
(`Schedule.device_stash_depth`: pipedream-v at P = 4 keeps 6 a device, its
slots' rings 5 + 3 = 8; PipeDream folded two a device on the V keeps S + 1,
the rings S + P).

A pool holds that figure: one array of `Program.pool_size` rows a device,
each row tagged with the local slot that owns it and the version it holds
(`owner` -1: empty). A slot reads its versions through a `PoolView` (the
pool's arrays, its own rows found by tag, as a ring finds its versions),
and an update overwrites the row the program planned for it
(`program._plan_pool`): a dead version of its own slot, or of another slot
on the device (the tables name it by that slot and by its lag behind the
updating stage's latest, `Instructions.evict_slot`, `evict`), or an empty
row. In a tick every slot's task reads the pool first; then the slots'
updates run one after another on it (`tick.pooled_updates`, the lanes'
`run_update`), each reading it under its conditional and storing its new
version after it (`claim`). A drain plans its rows again from the pool as
it stands (`replan`).

`Pipeline(stash="pooled")`, config `stash`; docs/executor.md, "A pooled
stash".
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import packing
from stalepipe.pipeline import program as program_lib

MODES = ("slots", "pooled")


class StashPool(NamedTuple):
  """A device's pooled weight versions (`PipelineState.ring` is `(pool,)`)."""

  params: packing.Flat  # dtype -> [D, P, R, L]: one packed version a row
  versions: jax.Array  # int32 [D, P, R]: the version in each row
  owner: jax.Array  # int32 [D, P, R]: the local slot owning it; -1 empty
  latest: jax.Array  # int32 [D, P, F]: updates each slot's stage applied


class PoolView(NamedTuple):
  """Slot `slot`'s view of its device's pool inside the tick: reads and
  writes its versions as `tick.read_version` and `tick.write_version` do a
  ring's."""

  params: packing.Flat  # dtype -> [R, L]
  versions: jax.Array  # int32 [R]
  owner: jax.Array  # int32 [R]
  latest: jax.Array  # int32 []: this slot's
  slot: jax.Array  # int32 []


def check(stash: str, num_slots: int, sharded: bool,
          whole_model: bool) -> bool:
  """Whether `stash` asks for a pool; refuses what a pool does not run."""
  if stash not in MODES:
    raise ValueError(f"stash={stash!r} is invalid; valid: {', '.join(MODES)}")
  if stash == "slots":
    return False
  for refused, why in ((num_slots == 1, "a device holds one stage"),
                       (sharded, "a stage is sharded over 'fsdp'"),
                       (whole_model, 'optimizer_scope="model"')):
    if refused:
      raise ValueError(f'stash="pooled" is not run where {why}; valid: '
                       'stash="slots" there')
  return True


def views(pool: StashPool) -> list[PoolView]:
  """Each local slot's view of this device's pool (`[R, ...]` blocks)."""
  return [PoolView(pool.params, pool.versions, pool.owner, pool.latest[j],
                   jnp.int32(j)) for j in range(pool.latest.shape[0])]


def rebase(view: PoolView, on: PoolView) -> PoolView:
  """`view` on the pool as `on` left it (an earlier slot's update)."""
  return view._replace(params=on.params, versions=on.versions,
                       owner=on.owner)


def joined(done: list[PoolView]) -> StashPool:
  """The pool after every slot's update (each rebased on the one before)."""
  last = done[-1]
  return StashPool(last.params, last.versions, last.owner,
                   jnp.stack([v.latest for v in done]))


def row(view: PoolView, version) -> jax.Array:
  """The row holding this slot's `version`."""
  return jnp.argmax((view.versions == version) & (view.owner == view.slot))


class Write(NamedTuple):
  """An update's new version, to be stored in the pool (`claim`) outside
  the update's conditional: a conditional that wrote the pool itself would
  make XLA copy the whole pool, in both of its branches."""

  row: jax.Array  # int32 []: the row it overwrites
  params: packing.Flat  # dtype -> [L]
  done: jax.Array  # bool []: False where the slot had no update


def write(view: PoolView, params: packing.Flat, evict, evict_slot) -> Write:
  """This slot's next version, over local slot `evict_slot`'s version
  `evict` updates behind this slot's latest (an empty row where
  `evict_slot` < 0)."""
  taken = jnp.argmax((view.owner == evict_slot)
                     & (view.versions == view.latest - evict))
  at = jnp.where(evict_slot >= 0, taken, jnp.argmax(view.owner == -1))
  return Write(at, params, jnp.ones((), bool))


def no_write(view: PoolView) -> Write:
  """`write`'s value where the slot has no update (a row it does not
  store)."""
  return Write(jnp.int32(0), {k: jnp.zeros(v.shape[1:], v.dtype)
                              for k, v in view.params.items()},
               jnp.zeros((), bool))


def store(params: packing.Flat, new: Write) -> packing.Flat:
  """`params` with `new`'s row written in place where `new.done`."""
  put = lambda v, x: jax.lax.dynamic_update_index_in_dim(v, x, new.row, 0)  # pylint: disable=unnecessary-lambda-assignment
  return jax.lax.cond(
      new.done, lambda p: {k: put(v, new.params[k]) for k, v in p.items()},
      lambda p: p, params)


def claim(view: PoolView, new: Write, after) -> PoolView:
  """`view` with `new` stored in its row and tagged as this slot's next
  version, where `new.done` (`after`: True, computed from what every slot's
  task of the tick returned, so that XLA writes the pool in place after
  those tasks' reads rather than copying it)."""
  keep = lambda x, y: jnp.where(new.done, x, y)  # pylint: disable=unnecessary-lambda-assignment
  tag = lambda v, x: v.at[new.row].set(keep(x, v[new.row]))  # pylint: disable=unnecessary-lambda-assignment
  return view._replace(
      params=store(view.params, new._replace(done=new.done & after)),
      versions=tag(view.versions, view.latest + 1),
      owner=tag(view.owner, view.slot), latest=keep(view.latest + 1,
                                                    view.latest))


def initial(params: packing.Flat, stages: np.ndarray, size: int) -> StashPool:
  """Every device's pool with version 0 of its slot j's stage in row j and
  the other rows empty (`stages`: `[P, F]`, the placement's)."""
  P, F = stages.shape
  pool = {k: np.zeros((P, size) + v.shape[1:], v.dtype)
          for k, v in params.items()}
  for k, v in params.items():
    pool[k][:, :F] = np.asarray(v)[stages]
  owner = np.full((P, size), -1, np.int32)
  owner[:, :F] = np.arange(F)
  return StashPool(pool, np.where(owner >= 0, 0, -1).astype(np.int32), owner,
                   np.zeros((P, F), np.int32))


def latest_row(versions: np.ndarray, owner: np.ndarray, latest: np.ndarray,
               slot: int) -> int:
  """On the host, for one device: the row of slot `slot`'s latest version."""
  return int(np.argmax((versions == latest[slot]) & (owner == slot)))


def replan(tables: list, pool: StashPool, stages: np.ndarray) -> list:
  """A drain's tables (`program.drain_table`, one per window, `[1, T, S]`
  columns) with the rows their updates overwrite planned from the pool as
  it stands (`pool`: one replica's host arrays, `[P, ...]`).

  The program plans each update's row for a run that goes on; a drain
  leaves out the updates of minibatches it does not finish, so a version the
  program would overwrite may not exist, or be a slot's latest. Here each
  device's rows are planned again (`program.pool_evictions`) over the
  drain's own reads and updates.
  """
  T = tables[0].kind.shape[1]
  evict = [np.array(t.evict) for t in tables]
  evict_slot = [np.array(t.evict_slot) for t in tables]
  for d, device_stages in enumerate(stages):
    F = len(device_stages)
    latest = [int(x) for x in pool.latest[d]]
    reads, update_reads = [{} for _ in range(F)], [{} for _ in range(F)]
    updates, at = [], {}
    for w, table in enumerate(tables):
      for t in range(T):
        now = w * T + t
        for j, s in enumerate(device_stages):
          if table.kind[0, t, s] != program_lib.IDLE:
            reads[j][latest[j] - table.lag[0, t, s]] = now
        for j, s in enumerate(device_stages):
          if table.update[0, t, s] == 1:
            for lag in (0, table.update_lag[0, t, s]):
              update_reads[j][latest[j] - lag] = now
            updates.append((now, j))
            at[(now, j)] = (w, t, s)
            latest[j] += 1
    live = {(int(o), int(v)) for o, v in zip(pool.owner[d], pool.versions[d])
            if o >= 0}
    plan = program_lib.pool_evictions(
        updates, reads, update_reads, pool.owner.shape[-1], live,
        [int(x) for x in pool.latest[d]])
    if plan is None:
      raise ValueError(f"device {d}'s pooled stash of "
                       f"{pool.owner.shape[-1]} rows cannot hold the drain's "
                       "versions; valid: stash=\"slots\"")
    for key, (o, lag) in plan.items():
      w, t, s = at[key]
      evict[w][0, t, s], evict_slot[w][0, t, s] = lag, o
  return [t._replace(evict=e, evict_slot=o)
          for t, e, o in zip(tables, evict, evict_slot)]
