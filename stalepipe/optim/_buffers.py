"""State buffers that take their parameter's sharding, and markers for absent ones."""

import chex
import jax.numpy as jnp
import optax


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


def absent() -> optax.MaskedNode:
  """The marker of a leaf that keeps no buffer, as in `optax.masked`.

  An empty pytree node, not a zero-size array: checkpointers (orbax) save it
  as nothing, where they refuse arrays of size 0.
  """
  return optax.MaskedNode()


def is_absent(x) -> bool:
  return isinstance(x, optax.MaskedNode)

