"""Cutting a sequence of Flax NNX blocks into pipeline stages.

A stalepipe model is a list of blocks, each an `nnx.Module` mapping one array
to the next. `split` cuts the list at block boundaries into stage functions
`f_s(params_s, x) -> x` over plain-dict parameters, the form every executor
takes. Blocks must hold no mutable state besides `nnx.Param` (no BatchNorm).
"""

import inspect
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from stalepipe.pipeline import split_backward
from stalepipe.pipeline import stage as stage_lib

StageFn = Callable[[object, jax.Array], jax.Array]


class Staged(NamedTuple):
  """A model cut into stages."""

  stage_fns: tuple[StageFn, ...]  # f_s(params_s, x) -> x
  stage_params: tuple[object, ...]  # params_s: a tuple of per-block dicts
  boundaries: tuple[int, ...]  # index of the first block of each stage


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


def _path_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _refuse_state(module: nnx.Module) -> None:
  """Refuses mutable non-parameter state (BatchNorm statistics, counters):
  a stage's forward would have to update it, which the executors do not."""
  for path, value in nnx.iter_graph(module):
    if isinstance(value, nnx.Variable) and not isinstance(
        value, (nnx.Param, nnx.RngState)):
      raise ValueError(
          f"{type(value).__name__} {'.'.join(map(str, path))!r} is "
          "non-parameter state a stage's forward would update, which the "
          "pipelines do not carry; valid: a model whose only state is "
          "nnx.Param (e.g. LayerNorm instead of BatchNorm)")


def cut(module: nnx.Module, stages: Sequence[Callable], example) -> Staged:
  """Cuts an NNX module into stages, each a function of the module.

  `stages[s](model, x, **kw) -> y` runs stage s's part of the module (glue
  included: a positional table, a final norm); it may declare `key` and
  `train` (`stalepipe.pipeline.stage`). Each stage's parameters are the
  module's `nnx.Param`s its function reads, found by tracing it on
  `example` (stage 0's input for one micro-batch) and the previous stages'
  outputs. Like torch's `pipelining.pipeline(module, split_spec)`, but the
  cut is named by code rather than by a graph pass.

  Args:
    module: the model; its only state must be `nnx.Param` (and RNG state).
    stages: S functions `(model, x, ...) -> y`.
    example: stage 0's input (arrays or `jax.ShapeDtypeStruct`s).

  Returns:
    The stages: `stage_params[s]` a flat dict `{"path.to.param": array}` of
    the parameters stage s reads; `merge(module, stage_params)` writes them
    back.

  Raises:
    ValueError: in one line, for a parameter no stage reads (it would be
      lost), one read by two stages (tied weights), or non-parameter state.

  Examples:
    >>> from flax import nnx
    >>> class Two(nnx.Module):
    ...   def __init__(self):
    ...     self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    ...     self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    >>> staged = cut(Two(), [lambda m, x: m.a(x), lambda m, x: m.b(x)],
    ...              jax.ShapeDtypeStruct((3, 4), "float32"))
    >>> [sorted(p) for p in staged.stage_params]
    [['a.bias', 'a.kernel'], ['b.bias', 'b.kernel']]
  """
  _refuse_state(module)
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  flat = {_path_name(path): leaf for path, leaf in
          jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
  names = list(flat)

  def rebuild(given: dict):
    """The module with `given` parameters, every other one a broadcast zero
    (never read: the stage reads only its own)."""
    values = [given[n] if n in given else jnp.broadcast_to(
        jnp.zeros((), flat[n].dtype), flat[n].shape) for n in names]
    state = jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(params)),
                               values)
    full = jax.tree.map(lambda a: a, params)
    nnx.replace_by_pure_dict(full, state)
    return nnx.merge(graphdef, full, rest)

  fns, owned, x = [], [], example
  for s, stage in enumerate(stages):
    asked = stage_lib.wants(stage)

    def read(values, x, stage=stage, asked=asked):
      kwargs = {}
      if "key" in asked:
        kwargs["key"] = jax.random.key(0)
      if "train" in asked:
        kwargs["train"] = True
      return stage(rebuild(dict(zip(names, values))), x, **kwargs)

    jaxpr = jax.make_jaxpr(read)([flat[n] for n in names], x)
    used = split_backward.read_inputs(jaxpr.jaxpr)[:len(names)]
    mine = [n for n, u in zip(names, used) if u]
    for n in mine:
      other = next((t for t, o in enumerate(owned) if n in o), None)
      if other is not None:
        raise ValueError(f"parameter {n!r} is read by stages {other} and {s}; "
                         "valid: each parameter in one stage (untie shared "
                         "weights)")
    owned.append(mine)
    x = jax.eval_shape(read, [flat[n] for n in names], x)
    fns.append(_module_stage(stage, rebuild))
  lost = [n for n in names if not any(n in o for o in owned)]
  if lost:
    raise ValueError(f"parameters {lost} are read by no stage and would be "
                     "lost; valid: stage functions that together read every "
                     "parameter")
  return Staged(stage_fns=tuple(fns),
                stage_params=tuple({n: flat[n] for n in o} for o in owned),
                boundaries=tuple(range(len(stages))))


def _module_stage(stage: Callable, rebuild: Callable) -> Callable:
  """`stage(model, x, ...)` as a function of its own flat parameters,
  declaring the `key` and `train` arguments `stage` declares."""
  def fn(p, x, **kwargs):
    return stage(rebuild(p), x, **kwargs)

  positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
  fn.__signature__ = inspect.Signature(
      [inspect.Parameter("p", positional), inspect.Parameter("x", positional)]
      + [inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY)
         for a in sorted(stage_lib.wants(stage))])
  return fn


def merge(module: nnx.Module, stage_params: Sequence[dict]) -> nnx.Module:
  """Writes a pipeline's trained stage parameters (`cut`'s flat dicts, e.g.
  `pipe.params(state)`) back into `module` (`nnx.update`), for evaluation,
  export or a checkpoint in the user's own format; returns it."""
  _, params, _ = nnx.split(module, nnx.Param, ...)
  flat_paths = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))
  given = {}
  for p in stage_params:
    given.update(p)
  names = [_path_name(path) for path, _ in flat_paths[0]]
  missing = [n for n in names if n not in given]
  if missing or len(given) != len(names):
    raise ValueError(f"stage parameters do not cover the module's "
                     f"(missing {missing[:3]}, {len(given)} given for "
                     f"{len(names)}); valid: the stage_params of cut(module)")
  pure = jax.tree.unflatten(flat_paths[1], [given[n] for n in names])
  nnx.replace_by_pure_dict(params, pure)
  nnx.update(module, params)
  return module
