"""Cutting a sequence of Flax NNX blocks into pipeline stages.

A stalepipe model is a list of blocks, each an `nnx.Module` mapping one array
to the next. `split` cuts the list at block boundaries into stage functions
`f_s(params_s, x) -> x` over plain-dict parameters, the form every executor
takes; its blocks must hold no mutable state besides `nnx.Param`. `cut`
cuts a whole module at code the user names, BatchNorm statistics included,
and `merge` writes a pipeline's weights and statistics back.
"""

import inspect
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stalepipe.pipeline import scope as scope_lib
from stalepipe.pipeline import split_backward
from stalepipe.pipeline import stage as stage_lib

StageFn = Callable[[object, jax.Array], jax.Array]


class Staged(NamedTuple):
  """A model cut into stages."""

  stage_fns: tuple[StageFn, ...]  # f_s(params_s, x) -> x
  stage_params: tuple[object, ...]  # params_s: a tuple of per-block dicts
  boundaries: tuple[int, ...]  # index of the first block of each stage
  stage_states: tuple | None = None  # `cut`: per stage its statistics (None
  #   for a stage without); None where no stage has any
  tied: tuple[str, ...] = ()  # `cut`: parameters several stages hold, for
  #   `Pipeline(..., tied=)`


def even_boundaries(num_blocks: int, num_stages: int) -> tuple[int, ...]:
  """First-block indices that spread `num_blocks` over `num_stages` evenly."""
  if not 1 <= num_stages <= num_blocks:
    raise ValueError(f"num_stages={num_stages} does not fit a model of "
                     f"{num_blocks} blocks; valid: 1 to {num_blocks}")
  return tuple(round(i * num_blocks / num_stages) for i in range(num_stages))


def _block_fn(block: nnx.Module) -> tuple[Callable, dict]:
  graphdef, state = nnx.split(block)

  def apply(params, x):
    block_state = jax.tree.map(lambda a: a, state)
    nnx.replace_by_pure_dict(block_state, params)
    return nnx.merge(graphdef, block_state)(x)

  return apply, nnx.to_pure_dict(state)


def _compose(fns: Sequence[Callable]) -> StageFn:
  def stage_fn(params, x):
    for fn, p in zip(fns, params):
      x = fn(p, x)
    return x
  return stage_fn


def split(blocks: Sequence[nnx.Module],
          boundaries: int | Sequence[int]) -> Staged:
  """Cuts `blocks` into stages.

  Args:
    blocks: the model, a sequence of NNX modules applied in order.
    boundaries: the number of stages (an even split), or the index of the
      first block of each stage, starting with 0 and strictly increasing.

  Returns:
    The stage functions, their parameters and the boundaries used.

  Examples:
    >>> from flax import nnx
    >>> blocks = [nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(4)]
    >>> staged = split(blocks, 2)
    >>> staged.boundaries
    (0, 2)
  """
  n = len(blocks)
  if isinstance(boundaries, int):
    boundaries = even_boundaries(n, boundaries)
  boundaries = tuple(int(b) for b in boundaries)
  ends = boundaries[1:] + (n,)
  if (not boundaries or boundaries[0] != 0
      or any(b >= e for b, e in zip(boundaries, ends))):
    raise ValueError(f"stage boundaries {boundaries} are invalid for {n} "
                     "blocks; valid: strictly increasing, starting at 0, "
                     f"each below {n}")
  fns, params = zip(*(_block_fn(b) for b in blocks))
  return Staged(
      stage_fns=tuple(_compose(fns[b:e]) for b, e in zip(boundaries, ends)),
      stage_params=tuple(tuple(params[b:e]) for b, e in zip(boundaries, ends)),
      boundaries=boundaries)


def unpipelined(staged: Staged) -> StageFn:
  """The whole model as one function of all stages' parameters."""
  return _compose(staged.stage_fns)


def _refuse_state(module: nnx.Module) -> None:
  """Refuses state other than parameters, BatchNorm-style statistics and
  RNG state (a decoding cache, sown intermediates): no executor carries
  it."""
  for path, value in nnx.iter_graph(module):
    if isinstance(value, nnx.Variable) and not isinstance(
        value, (nnx.Param, nnx.BatchStat, nnx.RngState)):
      raise ValueError(
          f"{type(value).__name__} {'.'.join(map(str, path))!r} is state the "
          "pipelines do not carry; valid: nnx.Param, nnx.BatchStat (carried "
          "per stage) and RNG state")


def _names(tree) -> dict:
  """`{"path.to.leaf": leaf}` of a nested dict."""
  return {scope_lib.leaf_name(path): leaf for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _flat(state) -> dict:
  """`{"path.to.leaf": array}` of an nnx.State."""
  return _names(nnx.to_pure_dict(state))


def _paths(state) -> dict:
  """`{"path.to.leaf": (keys, ...)}` of an nnx.State."""
  return {scope_lib.leaf_name(path): tuple(getattr(k, "key", k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(
              nnx.to_pure_dict(state))[0]}


def _nested(paths: dict, leaves: dict) -> dict:
  """The module's nested dict holding only `leaves` (`{name: leaf}`), at
  their `paths`: a stage's part of `nnx.to_pure_dict(state)`."""
  tree = {}
  for name, leaf in leaves.items():
    node = tree
    for k in paths[name][:-1]:
      node = node.setdefault(k, {})
    node[paths[name][-1]] = leaf
  return tree


def _filled(state, flat: dict, given: dict):
  """`state` with `given` leaves, every other one a broadcast zero (never
  read: a stage reads only its own)."""
  values = [given[n] if n in given else jnp.broadcast_to(
      jnp.zeros((), v.dtype), v.shape) for n, v in flat.items()]
  pure = jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(state)),
                            values)
  full = jax.tree.map(lambda a: a, state)
  nnx.replace_by_pure_dict(full, pure)
  return full


def _owned(jaxpr, num_params: int, num_stats: int) -> tuple[list, list,
                                                             bool]:
  """From the jaxpr of `(param leaves, stat leaves, x, key) -> (y, new
  stats)`: which parameters it reads, which statistics it reads or writes
  (a statistic passed through unchanged is neither), and whether it reads
  the key."""
  stat_in = jaxpr.invars[num_params:num_params + num_stats]
  stat_out = jaxpr.outvars[len(jaxpr.outvars) - num_stats:]
  written = [o is not i for i, o in zip(stat_in, stat_out)]
  kept = jaxpr.outvars[:len(jaxpr.outvars) - num_stats] + [
      o for o, w in zip(stat_out, written) if w]
  read = split_backward.read_inputs(jaxpr.replace(outvars=kept))
  return (read[:num_params],
          [r or w for r, w in zip(read[num_params:num_params + num_stats],
                                  written)], read[-1])


def _keyed(keys, counts, key: jax.Array):
  r"""The module's RNG streams (`nnx.Rngs`, an `nnx.Dropout`'s) drawn from
  a stage's `key`: stream i's key :math:`\mathrm{fold}(key, i)`, in the
  module's path order, its count 0 (fresh Variables of this trace)."""
  leaves, treedef = jax.tree.flatten(keys)
  keys = jax.tree.unflatten(treedef, [
      jax.random.fold_in(key, i) for i in range(len(leaves))])
  return keys, jax.tree.map(jnp.zeros_like, counts)


def _python_scalars(y) -> list[str]:
  """The leaves of a stage's output that are Python (or NumPy) scalars."""
  y = y.value if isinstance(y, stage_lib.Output) else y
  return [jax.tree_util.keystr(path) or "the output" for path, leaf in
          jax.tree_util.tree_flatten_with_path(y)[0]
          if isinstance(leaf, (bool, int, float, complex, np.generic))]


def _claim(owned: list, mine: list, s: int, what: str,
           tied=frozenset()) -> None:
  for n in mine:
    other = next((t for t, o in enumerate(owned) if n in o), None)
    if other is not None and n not in tied:
      raise ValueError(
          f"{what} {n!r} is read by stages {other} and {s}; valid: each "
          f"{what} in one stage" + (" or, tied, named in cut(..., tied=)"
                                    if what == "parameter" else ""))
  owned.append(mine)


def cut(module: nnx.Module, stages: Sequence[Callable], example,
        tied: Sequence[str] = ()) -> Staged:
  """Cuts an NNX module into stages, each a function of the module.

  `stages[s](model, x, **kw) -> y` runs stage s's part of the module (glue
  included: a positional table, a final norm); it may declare `key` and
  `train` (`stalepipe.pipeline.stage`). Each stage's parameters are the
  module's `nnx.Param`s its function reads, found by tracing it on
  `example` (stage 0's input for one micro-batch) and the previous stages'
  outputs. Its state is the `nnx.BatchStat`s its training forward reads or
  updates (a BatchNorm's running statistics): the stage function then takes
  `state` and returns its update (`stage.Output`), which the executors
  carry per stage. Like torch's `pipelining.pipeline(module, split_spec)`,
  but the cut is named by code rather than by a graph pass.

  Args:
    module: the model; its state may be `nnx.Param`, `nnx.BatchStat` and
      RNG state.
    stages: S functions `(model, x, ...) -> y`.
    example: stage 0's input (arrays or `jax.ShapeDtypeStruct`s).
    tied: names of parameters several stages read (a head tied to the
      embedding: `("embed.embedding",)`); each such stage holds a copy, and
      `Pipeline(..., tied=staged.tied)` sums their gradients and applies
      one update on every copy, as Megatron's embedding group does.

  Returns:
    The stages: `stage_params[s]` the parameters stage s reads, as the part
    of the module's own nested dict `nnx.to_pure_dict(nnx.state(module,
    nnx.Param))` that holds them (`{"blocks": {0: {"attn": ...}}}`), so an
    optax mask or label function sees the paths it sees in unpipelined
    training; `stage_states[s]` that of its statistics (None for a stage
    without); `merge(module, stage_params, stage_states)` writes them
    back.

  Raises:
    ValueError: in one line, for a parameter no stage reads (it would be
      lost), a parameter read by two stages and not named in `tied` or a
      statistic read by two, or state no executor carries.

  Examples:
    >>> from flax import nnx
    >>> class Two(nnx.Module):
    ...   def __init__(self):
    ...     self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    ...     self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    >>> staged = cut(Two(), [lambda m, x: m.a(x), lambda m, x: m.b(x)],
    ...              jax.ShapeDtypeStruct((3, 4), "float32"))
    >>> [{k: sorted(v) for k, v in p.items()} for p in staged.stage_params]
    [{'a': ['bias', 'kernel']}, {'b': ['bias', 'kernel']}]
  """
  _refuse_state(module)
  graphdef, params, stats, keys, counts, rest = nnx.split(
      module, nnx.Param, nnx.BatchStat, nnx.RngKey, nnx.RngCount, ...)
  flat, flat_stats = _flat(params), _flat(stats)
  names, stat_names = list(flat), list(flat_stats)
  paths = {**_paths(params), **_paths(stats)}
  unknown = [n for n in tied if n not in flat]
  if unknown:
    raise ValueError(f"tied {unknown} are not parameters of the module; "
                     f"valid: names such as {names[:3]}")

  def rebuild(given: dict, given_stats: dict, key: jax.Array):
    """The module with `given` parameters and statistics, its RNG streams
    drawn from `key`."""
    return nnx.merge(graphdef, _filled(params, flat, given),
                     _filled(stats, flat_stats, given_stats),
                     *_keyed(keys, counts, key), rest)

  fns, owned, owned_stats, x, constants = [], [], [], example, []
  for s, stage in enumerate(stages):
    asked, out = stage_lib.wants(stage), {}

    def read(values, stat_values, x, key_data, stage=stage, asked=asked,
             out=out):
      key = jax.random.wrap_key_data(key_data)
      kwargs = {"key": key} if "key" in asked else {}
      if "train" in asked:
        kwargs["train"] = True
      model = rebuild(dict(zip(names, values)),
                      dict(zip(stat_names, stat_values)), key)
      y = out["y"] = stage(model, x, **kwargs)
      new = _flat(nnx.state(model, nnx.BatchStat))
      return y, [new[n] for n in stat_names]

    args = ([flat[n] for n in names], [flat_stats[n] for n in stat_names], x,
            stage_lib.key_struct())
    try:
      jaxpr = jax.make_jaxpr(read)(*args)
    except Exception as e:  # pylint: disable=broad-except
      if not constants:
        raise
      raise ValueError(
          f"stage {s - 1} passes Python scalars at {', '.join(constants)} "
          f"to stage {s}, "
          "where they arrive traced, as arrays (every boundary value is), "
          f"and fail ({type(e).__name__}); valid: constants (a slice bound, "
          "a length) in the stage function that uses them, arrays across "
          "the boundary") from e
    constants = _python_scalars(out["y"])
    used, used_stats, draws = _owned(jaxpr.jaxpr, len(names),
                                     len(stat_names))
    _claim(owned, [n for n, u in zip(names, used) if u], s, "parameter",
           frozenset(tied))
    _claim(owned_stats, [n for n, u in zip(stat_names, used_stats) if u], s,
           "statistic")
    x = jax.eval_shape(read, *args)[0]
    x = x.value if isinstance(x, stage_lib.Output) else x
    fns.append(_module_stage(stage, rebuild, owned_stats[-1], paths, draws))
  lost = [n for n in names if not any(n in o for o in owned)]
  if lost:
    raise ValueError(f"parameters {lost} are read by no stage and would be "
                     "lost; valid: stage functions that together read every "
                     "parameter")
  return Staged(
      stage_fns=tuple(fns),
      stage_params=tuple(_nested(paths, {n: flat[n] for n in o})
                         for o in owned),
      boundaries=tuple(range(len(stages))),
      stage_states=(tuple(_nested(paths, {n: flat_stats[n] for n in o})
                          if o else None for o in owned_stats)
                    if any(owned_stats) else None),
      tied=tuple(tied))


def _module_stage(stage: Callable, rebuild: Callable, stats: Sequence[str],
                  paths: dict, draws: bool) -> Callable:
  """`stage(model, x, ...)` as a function of its own parameters (the
  module's nested dict of them), declaring the `key` and `train` arguments
  `stage` declares, `key` also where it draws from the module's RNG
  streams (`draws`: an `nnx.Dropout`; they are drawn from the key), and
  `state` (its statistics, returned updated in `stage.Output`) where it has
  any."""
  own = stage_lib.wants(stage)

  def fn(p, x, **kwargs):
    state = kwargs.pop("state", {})
    key = kwargs["key"] if "key" in own else kwargs.pop(
        "key", jax.random.key(0))
    model = rebuild(_names(p), _names(state), key)
    out = stage(model, x, **kwargs)
    if not stats:
      return out
    new = _flat(nnx.state(model, nnx.BatchStat))
    out = out if isinstance(out, stage_lib.Output) else stage_lib.Output(out)
    return out._replace(state=_nested(paths, {n: new[n] for n in stats}))

  positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
  asked = set(own) | ({"state"} if stats else set()) | (
      {"key"} if draws else set())
  fn.__signature__ = inspect.Signature(
      [inspect.Parameter("p", positional), inspect.Parameter("x", positional)]
      + [inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY)
         for a in sorted(asked)])
  return fn


def _write_back(module: nnx.Module, kind, stage_trees: Sequence,
                what: str) -> None:
  """Writes stage trees (`cut`'s nested dicts) of `kind` variables into
  `module`."""
  state = nnx.state(module, kind)
  flat = _flat(state)
  given = {}
  for p in stage_trees:
    given.update(_names(p or {}))
  missing = [n for n in flat if n not in given]
  if missing or len(given) != len(flat):
    raise ValueError(f"stage {what} do not cover the module's (missing "
                     f"{missing[:3]}, {len(given)} given for {len(flat)}); "
                     f"valid: the stage_{what} of cut(module)")
  # Each value where the module's is (its sharding: `nnx.with_partitioning`).
  placed = [jax.device_put(given[n], flat[n].sharding)
            if isinstance(flat[n], jax.Array) else given[n] for n in flat]
  pure = jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(state)),
                            placed)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(module, state)


def merge(module: nnx.Module, stage_params: Sequence[dict],
          stage_states: Sequence[dict | None] | None = None) -> nnx.Module:
  """Writes a pipeline's trained stage parameters (`cut`'s nested dicts, e.g.
  `pipe.params(state)`) and, where given, the stages' statistics
  (`pipe.stage_states(state)`) back into `module` (`nnx.update`), for
  evaluation, export or a checkpoint in the user's own format; returns it.
  Each value lands where the module's was (its sharding, e.g. from
  `nnx.with_partitioning`). Statistics no stage holds keep their values."""
  _write_back(module, nnx.Param, stage_params, "params")
  if stage_states is not None:
    flat = _flat(nnx.state(module, nnx.BatchStat))
    given = {n: v for t in stage_states for n, v in _names(t or {}).items()}
    _write_back(module, nnx.BatchStat,
                [{**{n: v for n, v in flat.items() if n not in given},
                  **given}], "states")
  return module
