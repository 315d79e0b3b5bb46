"""Stale gradients: a ring buffer that hands back the gradient of `delay` calls ago."""

from typing import Callable, NamedTuple, Union

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe.optim import _ordering

Delay = Union[int, chex.ArrayTree, Callable[[optax.Params], chex.ArrayTree]]


class StaleGradientsState(NamedTuple):
  """State of `stale_gradients`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  buffer: optax.Updates  # per leaf [delay, *leaf.shape] in the leaf's dtype.


def _check_delay(delay: int) -> int:
  if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
    raise ValueError(f"delay={delay!r} is invalid; valid: an int >= 0")
  return delay


def leaf_delays(delay: Delay, tree: chex.ArrayTree) -> chex.ArrayTree:
  """The delay of every leaf of `tree`: `delay` broadcast, called or checked."""
  if callable(delay):
    delay = delay(tree)
  if isinstance(delay, int):
    _check_delay(delay)
    return jax.tree.map(lambda _: delay, tree)
  return jax.tree.map(lambda d, _: _check_delay(d), delay, tree)


def stale_gradients(delay: Delay) -> optax.GradientTransformation:
  r"""Delays gradients by `delay` calls: PipeSGD's stale gradient pipeline.

  At call :math:`t` the transform emits the gradient it was handed `delay`
  calls earlier, and zeros during warm-up:

  .. math::
    \operatorname{out}_t = \begin{cases} g_{t-d} & t \ge d \\ 0 & t < d
    \end{cases}

  so `optax.chain(stale_gradients(d), optax.sgd(lr))` gives
  :math:`x_{t+1} = x_t - \eta\, g_{t-d}`. `delay=0` is the identity.

  Partial staleness (SAPipe §3.1: only the first k layers are stale) is either
  `optax.masked(stale_gradients(1), mask)` or a pytree of per-leaf delays with
  zeros for fresh leaves; either way the ring buffer holds only stale leaves
  (a fresh leaf's buffer has shape `[0, *shape]`). The state keeps each leaf's
  dtype (float32 and bfloat16 leaves may be mixed).

  Args:
    delay: an int >= 0; or a pytree of ints with the structure of the params;
      or a callable mapping params to such a pytree.

  Returns:
    An `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = stale_gradients(2)
    >>> state = opt.init(jnp.zeros(()))
    >>> outs = []
    >>> for g in [1., 2., 3., 4.]:
    ...   out, state = opt.update(jnp.asarray(g), state)
    ...   outs.append(float(out))
    >>> outs
    [0.0, 0.0, 1.0, 2.0]

  References:
    Li et al, `Pipe-SGD: A Decentralized Pipelined SGD Framework for
    Distributed Deep Net Training <https://arxiv.org/abs/1811.03619>`_, 2018;
    Chen et al, SAPipe (seed 004) Algorithm 1 and §3.1, 2022.
  """
  if not callable(delay):
    jax.tree.map(_check_delay, delay)

  def init_fn(params):
    delays = leaf_delays(delay, params)
    buffer = jax.tree.map(
        lambda d, p: jnp.zeros((d, *jnp.shape(p)), jnp.asarray(p).dtype),
        delays, params)
    return StaleGradientsState(count=jnp.zeros([], jnp.int32), buffer=buffer)

  def update_fn(updates, state, params=None):
    del params
    delays = leaf_delays(delay, updates)

    # A static slot for delay 1 lets XLA update the buffer in place.
    slot = lambda d: 0 if d == 1 else state.count % d  # pylint: disable=unnecessary-lambda-assignment

    def emit(d, g, buf):
      # Zeros in the initial buffer make the warm-up output zero.
      return g if d == 0 else buf[slot(d)].astype(g.dtype)

    def store(d, g, buf):
      return buf if d == 0 else buf.at[slot(d)].set(g.astype(buf.dtype))

    stale = jax.tree.map(emit, delays, updates, state.buffer)
    # The update built from `stale` needs nothing of this call's gradient; a
    # dependency on it orders the params' write after the forward pass read
    # them, so XLA updates donated params in place instead of copying them.
    stale = _ordering.computed_after(stale, updates)
    buffer = jax.tree.map(store, delays, updates, state.buffer)
    return stale, StaleGradientsState(
        count=optax.safe_increment(state.count), buffer=buffer)

  return optax.GradientTransformation(init_fn, update_fn)
