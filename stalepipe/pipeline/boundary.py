"""What crosses a stage boundary: pytrees, each leaf in its own dtype.

A stage's input may be any pytree of arrays (hidden state beside an attention
mask, token ids beside positions); each leaf crosses the boundary with its
own dtype and shape. Both executors carry it as it is: the shard_map
executor packs a boundary's leaves into one flat row per dtype
(`packing.Packing`), so an int32 id travels in an int32 row beside a
bfloat16 hidden state, never cast to a common type.

Cotangents flow back only for the inexact (floating) leaves: an integer
leaf's cotangent is `float0` in JAX and carries nothing, so its row holds
none and the receiver rebuilds the zero-size `float0` leaf.
"""

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import packing


def is_differentiable(leaf) -> bool:
  """Whether a leaf has a real cotangent (an inexact dtype)."""
  return jnp.issubdtype(leaf.dtype, jnp.inexact)


def differentiable(tree: Any) -> Any:
  """`tree` with every leaf that has no real cotangent replaced by None."""
  return jax.tree.map(lambda v: v if is_differentiable(v) else None, tree)


class Boundaries(NamedTuple):
  """The stages' inputs (one micro-batch each) and their buffer layouts."""

  inputs: tuple  # per stage s, its input's pytree of ShapeDtypeStruct;
  #   stage 0's comes from the window, the others from stage s-1's output
  acts: packing.Packing  # stage s's input as flat rows per dtype (stage 0:
  #   empty: it reads the window)
  cots: packing.Packing  # the cotangent of stage s's input: its
  #   differentiable leaves

  def pack_input(self, s: int, x) -> packing.Flat:
    """Stage s's input (stage s-1's output) as one buffer row per dtype."""
    return self.acts.pack(s, x)

  def unpack_input(self, s: int, row: packing.Flat) -> Any:
    """Stage s's input from its buffer row, every leaf in its own dtype."""
    return self.acts.unpack(s, row)

  def pack_cotangent(self, s: int, cotangent) -> packing.Flat:
    """The cotangent of stage s's input, differentiable leaves only."""
    return self.cots.pack(s, differentiable(cotangent))

  def unpack_cotangent(self, s: int, row: packing.Flat) -> Any:
    """The cotangent of stage s's input, a `float0` zero for each leaf that
    has none (as `jax.vjp` wants for integer outputs)."""
    found = self.cots.unpack(s, row)
    return jax.tree.map(
        lambda c, x: (np.zeros(x.shape, jax.dtypes.float0) if c is None
                      else c),
        found, self.inputs[s], is_leaf=lambda v: v is None)


def analyse(stage_inputs: Sequence[Any]) -> Boundaries:
  """The buffer layouts of the stages' inputs (`stage_inputs[s]`: stage s's
  input, a pytree of `jax.ShapeDtypeStruct` for one micro-batch)."""
  inputs = tuple(stage_inputs)
  between = [{}] + list(inputs[1:])
  return Boundaries(
      inputs=inputs, acts=packing.Packing(between),
      cots=packing.Packing([differentiable(x) for x in between]))
