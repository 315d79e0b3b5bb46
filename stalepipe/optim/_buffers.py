"""State buffers that take their parameter's sharding, and markers for absent ones."""

from typing import Union

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import NamedSharding, PartitionSpec


def zeros_stack(leaf: chex.Array, depth: int) -> chex.Array:
  """`depth` stacked zero copies of `leaf`, `[depth, *leaf.shape]`, sharded like it.

  `jnp.zeros((depth, *shape))` would drop the leaf's sharding: under Explicit
  sharding the buffer would not even type-check against the leaf, and under
  FSDP it would be replicated. `zeros_like` keeps a concrete leaf's sharding
  (and a traced leaf's Explicit sharding); broadcasting adds an unsharded
  leading axis.

  Args:
    leaf: a parameter (array or scalar).
    depth: the number of copies, >= 1.

  Returns:
    Zeros of shape `[depth, *leaf.shape]` in the leaf's dtype.
  """
  leaf = jnp.asarray(leaf)
  return jnp.broadcast_to(jnp.zeros_like(leaf)[None], (depth, *leaf.shape))


def zeros_stacks(params: chex.ArrayTree,
                 depth: Union[int, chex.ArrayTree]) -> chex.ArrayTree:
  """`zeros_stack` of every leaf, absent where its depth is 0.

  A leaf that Flax annotates with sharding names (an `nnx.Variable`'s
  `out_sharding`, as `nnx.with_partitioning` sets it, and its
  `optimizer_sharding`; a linen `nn.Partitioned` box) keeps its annotation
  with the new leading axis named `None`, unsharded: `("tp",)` becomes
  `(None, "tp")`. Mapping over the leaves alone would give the stack the
  leaf's names, which put axis 0 on "tp" (`nnx.Optimizer` then refuses to
  build the state). This is how `nnx.vmap` and `nnx.scan` annotate the axis
  they add.

  Args:
    params: the params, plain arrays or Flax-annotated ones.
    depth: an int >= 0, or a pytree of them like `params`.

  Returns:
    A pytree like `params`: `[depth, *leaf.shape]` zeros per leaf, or
    `absent()` for depth 0.
  """
  if isinstance(depth, int):
    depth = jax.tree.map(lambda _: depth, params)
  stacks = jax.tree.map(lambda d, p: zeros_stack(p, d) if d else absent(),
                        depth, params)
  return _renamed(stacks, lambda names, ndim: (None, *names))


def unsharded_annotations(tree: chex.ArrayTree) -> chex.ArrayTree:
  """`tree` with each Flax sharding annotation replaced by one `None` per axis.

  For state built by mapping over the params whose leaves are not shaped
  like their parameter (a `[rows, rows]` basis of a `[rows, cols]` weight):
  the parameter's names would not fit, and such a leaf is kept unsharded.
  """
  return _renamed(tree, lambda names, ndim: (None,) * ndim)


def _renamed(tree, rename):
  """Flax-annotated leaves of `tree` with their names `rename(names, ndim)`.

  `rename` maps a tuple of names to a tuple; a PartitionSpec or a
  NamedSharding annotation stays one.
  """
  def new(names, ndim):
    if isinstance(names, NamedSharding):
      return NamedSharding(names.mesh, PartitionSpec(*rename(names.spec, ndim)))
    if isinstance(names, PartitionSpec):
      return PartitionSpec(*rename(tuple(names), ndim))
    return tuple(rename(tuple(names), ndim))

  def one(x):
    if isinstance(x, nnx.Variable):
      value = x.get_value()
      if is_absent(value):
        return x
      meta = x.get_metadata()
      names = {k: new(meta[k], jnp.ndim(value))
               for k in ("out_sharding", "optimizer_sharding") if meta.get(k)}
      return x.copy(**names) if names else x
    if isinstance(x, linen_meta.AxisMetadata) and hasattr(x, "names"):
      value = x.value
      return x if is_absent(value) else x.replace(
          names=new(x.names, jnp.ndim(value)))
    return x
  return jax.tree.map(one, tree, is_leaf=_is_annotated)


def _is_annotated(x) -> bool:
  return isinstance(x, (nnx.Variable, linen_meta.AxisMetadata))


def absent() -> optax.MaskedNode:
  """The marker of a leaf that keeps no buffer, as in `optax.masked`.

  An empty pytree node, not a zero-size array: checkpointers (orbax) save it
  as nothing, where they refuse arrays of size 0.
  """
  return optax.MaskedNode()


def is_absent(x) -> bool:
  return isinstance(x, optax.MaskedNode)

