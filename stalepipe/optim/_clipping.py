"""Clipping each parameter group by its own norm, as torch loops over `param_groups`."""

import operator
from typing import Any

import jax
import optax

from stalepipe.optim import _masks


def clip_by_group_norm(max_norm: float,
                       mask: Any = "attention_mlp"
                       ) -> optax.GradientTransformation:
  r"""Clips the leaves `mask` selects, and the others, each by its own norm.

  With :math:`G_1` the selected leaves and :math:`G_2` the rest,

  .. math::
    g \leftarrow g \cdot \min\Big(1, \frac{c}{\lVert G_k \rVert_2}\Big)
    \quad \text{for } g \in G_k,

  which is `torch.nn.utils.clip_grad_norm_(group["params"], c)` for each of
  two parameter groups. Chain it first to clip the raw gradient.

  Args:
    max_norm: :math:`c > 0`.
    mask: the first group: a name from `MASKS`, a pytree of bools or a
      callable returning one.

  Returns:
    An `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp
    >>> clip = clip_by_group_norm(1.0, {"a": True, "b": False})
    >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}
    >>> u, _ = clip.update(g, clip.init(g))
    >>> [round(float(v), 3) for v in (*u["a"], *u["b"])]
    [0.6, 0.8, 0.5]

  References:
    github.com/joonkyoo/basis-rotation, `optim/optimizer.py` lines 284-286
    (each group of the stage's `MultipleOptimizer`, the rotated weights and
    the AdamW ones, clipped on its own).
  """
  if not max_norm > 0:
    raise ValueError(f"max_norm={max_norm!r} is invalid; valid: a number > 0")
  first = _masks.mask(mask)

  def second(params):
    chosen = first(params) if callable(first) else first
    return jax.tree.map(operator.not_, chosen)

  clip = optax.clip_by_global_norm(max_norm)
  return optax.chain(optax.masked(clip, first), optax.masked(clip, second))
