"""Write a new state buffer only after the last read of the old one."""

import chex
import jax
import jax.numpy as jnp


def computed_after(tree: chex.ArrayTree, *deps: chex.ArrayTree) -> chex.ArrayTree:
  r"""`tree`, bit for bit, with a data dependency on every leaf of `deps`.

  .. math::
    \operatorname{out} = x \cdot (1 + 0 \cdot \mathrm{isnan}(\textstyle\sum
    \mathrm{deps}))

  is exactly :math:`x` (also for :math:`-0`, inf and NaN) but cannot be
  computed before `deps`. A transform whose new state buffer comes from fresh
  values (this call's gradient) while the old buffer is still read (to
  compute `deps`) makes XLA copy the donated buffer aside and copy the new
  value in: two extra passes and a temporary per buffer. Writing the new
  value `computed_after` the last read lets XLA reuse the donated buffer in
  place. Cost: one reduction over `deps` (a scalar dependency is free).

  Args:
    tree: the new buffer values; only floating leaves get the dependency.
    *deps: arrays or pytrees whose computation reads the old buffers last.

  Returns:
    `tree`, unchanged in value.

  Examples:
    >>> import jax.numpy as jnp
    >>> computed_after(jnp.array([-0.0, 2.0]), jnp.array(jnp.nan))
    Array([-0.,  2.], dtype=float32)
  """
  total = sum(jnp.sum(jnp.real(d)).astype(jnp.float32)
              for d in jax.tree.leaves(deps))
  one = 1 + 0 * jnp.isnan(total).astype(jnp.float32)

  def after(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):  # x * 1 is exact only here
      return x
    return x * one.astype(x.dtype)
  return jax.tree.map(after, tree)
