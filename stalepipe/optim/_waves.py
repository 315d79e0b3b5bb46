"""HetPipe wave accumulation: apply each minibatch locally, sum the wave for the server."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax


class WaveAccumulationState(NamedTuple):
  """State of `wave_accumulation`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  wave_updates: optax.Updates  # like params: sum of this wave's updates so far.


def wave_accumulation(wave_size: int) -> optax.GradientTransformation:
  r"""Passes updates through and sums them over waves of `wave_size` calls.

  A HetPipe virtual worker applies every minibatch's update :math:`u_p` to its
  local weights, and at the end of wave :math:`c` pushes the aggregate

  .. math::
    \tilde u_c = \sum_{p = c N_m}^{(c+1) N_m - 1} u_p

  to the parameter server (:math:`w_{global} \leftarrow w_{global} + \tilde
  u_c`). Place this transform last in the chain, so it sees the final
  updates. After the call that ends a wave, `state.wave_updates` holds
  :math:`\tilde u_c` and `wave_complete(state)` is true; the next call starts
  the next wave's sum. Where no local updates are applied (the worker only
  pushes), `optax.MultiSteps(opt, every_k_schedule=N_m, use_grad_mean=False)`
  already is the whole mechanism; this transform adds the local updates.

  Args:
    wave_size: :math:`N_m = s_{local} + 1`, minibatches per wave.

  Returns:
    An `optax.GradientTransformation`; its updates equal its inputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = wave_accumulation(2)
    >>> state = opt.init(jnp.zeros(()))
    >>> for u in [1., 2., 3.]:
    ...   _, state = opt.update(jnp.asarray(u), state)
    ...   print(float(state.wave_updates), bool(wave_complete(state, 2)))
    1.0 False
    3.0 True
    3.0 False

  References:
    Park et al, `HetPipe: Enabling Large DNN Training on (Whimpy)
    Heterogeneous GPU Clusters through Integration of Pipelined Model
    Parallelism and Data Parallelism
    <https://arxiv.org/abs/2005.14038>`_, 2020, §4 (WSP; seed 001).
  """
  if isinstance(wave_size, bool) or not isinstance(wave_size, int) or (
      wave_size < 1):
    raise ValueError(f"wave_size={wave_size!r} is invalid; valid: an int >= 1")

  def init_fn(params):
    return WaveAccumulationState(jnp.zeros([], jnp.int32),
                                 optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    fresh = state.count % wave_size == 0
    wave_updates = jax.tree.map(
        lambda acc, u: (jnp.where(fresh, 0, acc) + u).astype(acc.dtype),
        state.wave_updates, updates)
    return updates, WaveAccumulationState(optax.safe_increment(state.count),
                                          wave_updates)

  return optax.GradientTransformation(init_fn, update_fn)


def wave_complete(state: WaveAccumulationState, wave_size: int) -> chex.Array:
  """Whether the last call ended a wave, so `state.wave_updates` is whole."""
  return (state.count > 0) & (state.count % wave_size == 0)
