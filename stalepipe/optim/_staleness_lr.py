"""Staleness-aware learning rate: divide each update by its staleness."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax


class ScaleByStalenessState(NamedTuple):
  """`scale_by_staleness` keeps no state."""


def scale_by_staleness(
    staleness: Optional[chex.Numeric] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Scales updates by :math:`1/\max(\tau, 1)`: the staleness-aware rate.

  .. math::
    u \leftarrow \frac{u}{\max(\tau, 1)}

  so chained after `optax.sgd(lr)` the step size is :math:`\eta / \tau`.
  :math:`\tau` is fixed here, or given per call as the extra argument
  `staleness=` (asynchronous training, where each gradient has its own); a
  pytree like the params gives per-leaf (per-stage) staleness.

  Args:
    staleness: :math:`\tau`, a number or a pytree of numbers like the params;
      `None` requires `staleness=` on every call.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(optax.sgd(1.0), scale_by_staleness())
    >>> state = opt.init(jnp.zeros(()))
    >>> updates, _ = opt.update(jnp.asarray(4.0), state, staleness=2)
    >>> float(updates)
    -2.0

  References:
    Zhang et al, `Staleness-Aware Async-SGD for Distributed Deep Learning
    <https://arxiv.org/abs/1511.05950>`_, 2016 (SAPipe [32]).
  """

  def init_fn(params):
    del params
    return ScaleByStalenessState()

  def update_fn(updates, state, params=None, *, staleness=staleness,
                **extra_args: Any):
    del params, extra_args
    if staleness is None:
      raise ValueError("scale_by_staleness got staleness=None; valid: a number"
                       " or pytree, at construction or as an update argument")
    if jax.tree.structure(staleness) == jax.tree.structure(updates):
      taus = staleness
    else:
      taus = jax.tree.map(lambda _: staleness, updates)
    return jax.tree.map(
        lambda u, tau: (u / jnp.maximum(jnp.asarray(tau, u.dtype), 1)).astype(
            u.dtype), updates, taus), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
