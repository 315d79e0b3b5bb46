"""Cutting a sequence of Flax NNX blocks into pipeline stages.

A stalepipe model is a list of blocks, each an `nnx.Module` mapping one array
to the next. `split` cuts the list at block boundaries into stage functions
`f_s(params_s, x) -> x` over plain-dict parameters, the form every executor
takes. Blocks must hold no mutable state besides `nnx.Param` (no BatchNorm).
"""

from typing import Callable, NamedTuple, Sequence

import jax
from flax import nnx

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
