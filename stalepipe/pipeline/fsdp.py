"""A stage bigger than a device: each stage's trees cut over the 'fsdp' axis.

With a mesh ('data', 'stage', 'fsdp') of F > 1 devices on 'fsdp', every
device of a stage holds 1/F of it (ZeRO-3, as FSDP and MaxText's
`pipeline_fsdp_*` shard a stage): each leaf of a stage's weights, of every
weight version in its ring (the stash), of its gradient accumulator and of
its optimizer state is cut into F equal parts along one dimension
(`default_dim`: its largest dimension F divides, or a rule the user gives);
a leaf no dimension of which F divides is held whole by every member, and a
run says which (`Shards.replicated`). The member's parts of a stage's tree
are packed as one stage's tree is (`packing.py`), so the executor's rings,
accumulators and optimizer states hold `[L / F]`-long rows.

Inside the tick (`tick.py`), the task's collectives outside every
conditional (a `ppermute` under a `cond` has served wrong numbers from the
persistent compilation cache, docs/executor.md):

- before a slot's task runs, its row of the version the task reads (as the
  optimizer predicts it, where it does: each member its parts,
  `predicts_per_element`) is all-gathered over 'fsdp' (one `all_gather` per
  dtype), and the task merges the F parts into the whole tree
  (`Shards.merge`);
- each member runs the task on its 1/F of the micro-batch (the micro-batch
  axis is split over ('data', 'fsdp'), as ZeRO-3 splits the batch); the
  weight gradient is cut into F rows (`Shards.rows`) and reduce-scattered
  over 'fsdp' (`psum_scatter`, then / F: the mean of the members' equal
  sub-batch means, the micro-batch's mean);
- the update runs on the member's parts where the rule is elementwise
  (`elementwise`: SGD, Adam, diagonal delay compensation; no collective),
  else on the whole stage tree gathered over 'fsdp' (a global norm, full
  delay compensation's `<g, dx>`, Muon's Newton-Schulz: the numbers of the
  unsharded run), after which each member keeps its parts. These gathers
  sit under the update's `cond`, as the model scope's gathers over 'stage'
  do; `tests/compilation_cache_test.py` runs both from the persistent
  cache.
"""

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import contract

FSDP = "fsdp"

Rule = Callable[[str, tuple, int], "int | None"]


def default_dim(name: str, shape: tuple, size: int) -> int | None:
  """The dimension a leaf is cut along over `size` members: its largest
  dimension `size` divides (the first of equals), None if none does (the
  leaf is then held whole by every member)."""
  del name
  best = None
  for d, n in enumerate(shape):
    if n % size == 0 and n >= size and (best is None or n > shape[best]):
      best = d
  return best


def _leaf_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


class Shards:
  """How each of S trees is cut over `size` members.

  Args:
    trees: S trees (arrays or `ShapeDtypeStruct`s), one per stage.
    size: F, the members of a stage on 'fsdp'.
    rule: `rule(name, shape, F) -> dim or None` for each leaf (`name`, its
      dotted path); default `default_dim`. A dimension F does not divide is
      refused.
    like: an earlier `Shards` whose leaves' dimensions a leaf of this one
      takes where its path ends with theirs and its shape equals theirs (an
      optimizer state's `mu.w` is cut as the weight `w`).

  Examples:
    >>> import numpy as np
    >>> sh = Shards([{"w": np.zeros((4, 6)), "b": np.zeros(3)}], 2)
    >>> sh.dims[0], sh.replicated
    ([None, 1], ['stage 0: b (3,)'])
    >>> [v.shape for v in jax.tree.leaves(sh.trees[0])]
    [(3,), (4, 3)]
  """

  def __init__(self, trees: Sequence[Any], size: int, rule: Rule | None = None,
               like: "Shards | None" = None):
    self.size = size
    self.full = tuple(jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.dtype(v.dtype)), t)
                      for t in trees)
    self.dims, self.replicated, self.names = [], [], []
    known = {} if like is None else {
        name: (tuple(v.shape), d) for s in range(len(like.full))
        for name, v, d in zip(like.names[s], jax.tree.leaves(like.full[s]),
                              like.dims[s])}
    for s, tree in enumerate(self.full):
      paths = jax.tree_util.tree_flatten_with_path(tree)[0]
      names = [_leaf_name(p) for p, _ in paths]
      dims = []
      for name, (_, leaf) in zip(names, paths):
        shape = tuple(leaf.shape)
        match = [d for n, (sh, d) in known.items()
                 if sh == shape and (name == n or name.endswith("." + n))]
        dim = match[0] if match else (rule or default_dim)(name, shape, size)
        if dim is not None and (not 0 <= dim < len(shape)
                                or shape[dim] % size):
          raise ValueError(f"fsdp dimension {dim} of stage {s}'s leaf {name!r} "
                           f"{shape} is invalid; valid: a dimension {size} "
                           "divides, or None (held whole)")
        if dim is None and size > 1 and int(np.prod(shape)) > 1:
          self.replicated.append(f"stage {s}: {name} {shape}")
        dims.append(dim)
      self.dims.append(dims)
      self.names.append(names)
    self.trees = tuple(
        jax.tree.unflatten(jax.tree.structure(t), [
            jax.ShapeDtypeStruct(_part_shape(v.shape, d, size), v.dtype)
            for v, d in zip(jax.tree.leaves(t), dims)])
        for t, dims in zip(self.full, self.dims))

  def cut(self, s: int, tree, member):
    """Member `member`'s part of stage s's tree (traceable; `member` may be
    traced)."""
    leaves = jax.tree.leaves(tree)
    parts = []
    for v, d in zip(leaves, self.dims[s]):
      if d is None:
        parts.append(v)
      elif isinstance(member, (int, np.integer)) and not isinstance(
          v, jax.core.Tracer):
        n = v.shape[d] // self.size
        parts.append(np.asarray(v).take(
            np.arange(member * n, (member + 1) * n), axis=d))
      else:
        n = v.shape[d] // self.size
        parts.append(jax.lax.dynamic_slice_in_dim(v, member * n, n, axis=d))
    return jax.tree.unflatten(jax.tree.structure(self.full[s]), parts)

  def merge(self, s: int, members: Sequence[Any]):
    """Stage s's whole tree from its F members' parts (traceable): the parts
    joined along each leaf's dimension; a whole leaf is the first
    member's."""
    columns = zip(*[jax.tree.leaves(m) for m in members])
    leaves = [c[0] if d is None else jnp.concatenate(c, axis=d)
              for c, d in zip(columns, self.dims[s])]
    return jax.tree.unflatten(jax.tree.structure(self.full[s]), leaves)

  def merge_packed(self, s: int, layout, rows: dict):
    """Stage s's whole tree from its members' packed parts (`rows`: `[F,
    L]` per dtype, e.g. `gather`'s), each unpacked with `layout`."""
    return self.merge(s, [layout.unpack(s, {k: v[i] for k, v in rows.items()})
                          for i in range(self.size)])

  def parts(self, s: int, tree) -> list:
    """Stage s's tree cut into its F members' parts (a gradient's rows for
    the reduce-scatter: member i's part in row i)."""
    return [self.cut(s, tree, i) for i in range(self.size)]


class Sharded(NamedTuple):
  """What the tick knows of a stage sharded over 'fsdp'."""

  params: Shards  # how each stage's weights (and accumulator) are cut
  opt: Shards  # how each stage's optimizer state is cut
  elementwise: bool  # the rule steps on a member's parts (`elementwise`),
  #   else on the whole stage tree gathered over 'fsdp'

  @property
  def size(self) -> int:
    return self.params.size


def _part_shape(shape: tuple, dim: int | None, size: int) -> tuple:
  if dim is None:
    return tuple(shape)
  return tuple(n // size if d == dim else n for d, n in enumerate(shape))


def lead(sharded: "Sharded | None") -> int:
  """Leading block axes of a per-stage field: `[D, P, ...]`, or with a
  member axis `[D, P, F, ...]` on a sharded stage (`state.local`)."""
  return 2 if sharded is None else 3


def batch_axes(sharded: "Sharded | None", data: str = "data"):
  """The mesh axes a micro-batch is split over: 'data' (and 'fsdp')."""
  return data if sharded is None else (data, FSDP)


def gather(flat: dict) -> dict:
  """A member's packed row of each dtype, all-gathered over 'fsdp': `[F,
  L]` (row i member i's)."""
  return {k: jax.lax.all_gather(v, FSDP) for k, v in flat.items()}


def scatter_mean(rows: dict, size: int) -> dict:
  """`[F, L]` rows per dtype, summed over 'fsdp' with member i keeping row
  i, over F: the members' mean of their part (`psum_scatter`)."""
  return {k: (jax.lax.psum_scatter(v, FSDP, scatter_dimension=0) / size
              ).astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.inexact)
          else v[0] for k, v in rows.items()}


def member() -> jax.Array:
  """This device's index on 'fsdp' (inside the shard_map program)."""
  return jax.lax.axis_index(FSDP)


_STAND_IN_SHAPES = {"a": (4,), "b": (2, 4), "c": (4, 2)}


def elementwise(optimizer) -> bool:
  """Whether `optimizer` on a tree's halves (each leaf cut in two along its
  `default_dim`) gives the halves of it on the whole tree: its state's
  initial value and two steps' updates, at gradient scales 1e-4, 1 and 1e4
  (relative tolerance 1e-6; the stand-in of `scope.couples_stages`). Such a
  rule steps on each member's parts; any other on the gathered whole.
  A rule that fails on the stand-in counts as not elementwise."""
  rng = np.random.default_rng(0)
  draw = lambda: {k: rng.normal(size=v).astype(np.float32)  # pylint: disable=unnecessary-lambda-assignment
                  for k, v in _STAND_IN_SHAPES.items()}
  params, stale = draw(), draw()
  grads = [[jax.tree.map(lambda v, c=c: v * c, draw()) for _ in range(2)]
           for c in (1e-4, 1.0, 1e4)]
  shards = Shards([params], 2)

  def run(p, st, gs):
    state, out = optimizer.init(p), []
    for g in gs:
      kwargs = contract.extra_args(optimizer, True, stale_params=st,
                                   staleness=jnp.int32(1), local_updates=g)
      u, state = optimizer.update(g, state, p, **kwargs)
      out.append(u)
    return out + [state]

  def same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.shape(x) == np.shape(y) and np.allclose(x, y, rtol=1e-6, atol=0)
        for x, y in zip(la, lb))

  try:
    for gs in grads:
      whole = run(params, stale, gs)
      states = Shards([whole[-1]], 2, like=shards)
      for i in range(2):
        half = run(shards.cut(0, params, i), shards.cut(0, stale, i),
                   [shards.cut(0, g, i) for g in gs])
        if not (all(same(shards.cut(0, u, i), h)
                    for u, h in zip(whole[:-1], half[:-1]))
                and same(states.cut(0, whole[-1], i), half[-1])):
          return False
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def predicts_per_element(optimizer) -> bool:
  """Whether `optimizer.predict` on a state's and weights' halves (cut as
  `elementwise` cuts them) gives the halves of its prediction on the whole,
  after two steps at gradient scales 1e-4, 1 and 1e4: then each member
  predicts its parts before the gather, whether the update that made the
  state ran on parts or on the whole (SAPipe's option 3 reduces over the
  tree in its update, not in its prediction `x + ahead`)."""
  rng = np.random.default_rng(1)
  draw = lambda: {k: rng.normal(size=v).astype(np.float32)  # pylint: disable=unnecessary-lambda-assignment
                  for k, v in _STAND_IN_SHAPES.items()}
  params, shards = draw(), Shards([draw()], 2)
  counts = {"ahead": jnp.int32(2), "since_forward": jnp.int32(1)}
  if contract.pipeline_wide(optimizer):
    counts["pipeline_ahead"] = jnp.int32(3)
  try:
    for scale in (1e-4, 1.0, 1e4):
      state = optimizer.init(params)
      for _ in range(2):
        g = jax.tree.map(lambda v, c=scale: v * c, draw())
        kwargs = contract.extra_args(optimizer, True, stale_params=params,
                                     staleness=jnp.int32(1), local_updates=g)
        _, state = optimizer.update(g, state, params, **kwargs)
      states = Shards([state], 2, like=shards)
      whole = optimizer.predict(state, params, **counts)
      for i in range(2):
        half = optimizer.predict(states.cut(0, state, i),
                                 shards.cut(0, params, i), **counts)
        for a, b in zip(jax.tree.leaves(shards.cut(0, whole, i)),
                        jax.tree.leaves(half), strict=True):
          if np.shape(a) != np.shape(b) or not np.allclose(a, b, rtol=1e-6,
                                                           atol=0):
            return False
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def check(size: int, remat: str, optimizer, wants, tied) -> None:
  """Refuses, in one line, what a stage sharded over `size` > 1 members
  does not run: kept residuals (they would hold the gathered weights of
  every micro-batch in flight), a weight prediction that is not
  elementwise (each member predicts its parts before the gather), stages
  taking a PRNG key or a
  state (each member sees 1/F of the micro-batch: a dropout mask or a batch
  statistic would not be the unsharded run's) and tied parameters."""
  if size == 1:
    return
  where = f"a stage sharded over 'fsdp' ({size} devices)"
  if remat != "recompute":
    raise ValueError(f"remat={remat!r} on {where} is not supported; valid: "
                     "remat='recompute'")
  if contract.predicts(optimizer) and not predicts_per_element(optimizer):
    raise ValueError(f"a weight prediction that is not elementwise on {where} "
                     "is not supported (each member predicts its parts "
                     "before the gather); valid: an elementwise predict "
                     "(SAPipe's, SpecTrain's, PipeMare's), or fsdp=1")
  for s, takes in enumerate(wants):
    extras = sorted(set(takes) & {"key", "state"})
    if extras:
      raise ValueError(f"stage {s} takes {extras}, which on {where} would "
                       "differ from the unsharded run (each member sees 1/F "
                       "of a micro-batch); valid: stages without a key or "
                       "state, or fsdp=1")
  if tied:
    raise ValueError(f"tied parameters {sorted(tied)} on {where} are not "
                     "supported; valid: no tied parameters, or fsdp=1")


GATHERS = ("task", "window")


def check_gather(gather: str, schedule, size: int) -> None:
  """`gather` is "task" (each task gathers the version it reads: one
  all-gather a slot a tick, one whole version in flight) or "window"
  (MaxText's `pipeline_fsdp_ag_once`: each slot gathers its stage's latest
  version once before the window's ticks and every task reads it: 1/T of
  the traffic, the whole version held through the window). "window" only
  where every task of a window reads the version its stage had when the
  window began, checked on the schedule's version map over 4 windows: a
  flush schedule of one minibatch a window (gpipe, 1f1b, zb-h1, ...).

  Raises:
    ValueError: in one line, naming the value and what is valid.
  """
  if gather not in GATHERS:
    raise ValueError(f"fsdp_gather={gather!r} is invalid; valid: "
                     f"{', '.join(GATHERS)}")
  if gather == "task":
    return
  if size == 1:
    raise ValueError("fsdp_gather='window' is for a stage sharded over "
                     "'fsdp'; valid: 'task' with fsdp=1, or fsdp > 1")
  B = schedule.num_minibatches
  stream = schedule.with_minibatches(4 * B)
  for t in stream.tasks:
    if stream.version(t.minibatch, t.stage, t.kind) != t.minibatch // B * B:
      raise ValueError(
          f"fsdp_gather='window' on schedule {schedule.name!r} would serve "
          f"minibatch {t.minibatch}'s {t.kind} on stage {t.stage} a version "
          "other than the one it reads (an update lands inside the window); "
          "valid: fsdp_gather='task', or a flush schedule with one "
          "minibatch a window")
