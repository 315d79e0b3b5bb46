"""Stale gradients: a ring buffer that hands back the gradient of `delay` calls ago."""

from typing import Any, Callable, NamedTuple, Union

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe.optim import _buffers
from stalepipe.optim import _ordering

Delay = Union[int, chex.ArrayTree, Callable[[optax.Params], chex.ArrayTree]]
WARMUPS = ("skip", "zeros")


class StaleGradientsState(NamedTuple):
  """State of `stale_gradients`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  # Per leaf [delay, *leaf.shape] in the leaf's dtype and sharded like it;
  # `optax.MaskedNode()` for a leaf of delay 0.
  buffer: optax.Updates


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
  (a fresh leaf's buffer is `optax.MaskedNode()`, as in `optax.masked`). The
  state keeps each leaf's dtype (float32 and bfloat16 leaves may be mixed)
  and sharding, so it saves with orbax and runs under Explicit sharding.

  Warm-up: the zeros go through the optimizer chained after this transform,
  as PipeSGD's pipeline does (and DESIGN fixes). For plain or momentum SGD
  that is no update at all, but it advances the counters of Adam-like
  optimizers: after one zero step Adam's first real update is 0.744 lr, not
  lr. SAPipe's Algorithm 1 instead skips the optimizer ("Pass") until the
  first stale gradient exists; `stale_optimizer(opt, d)` does that.

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
    buffer = _buffers.zeros_stacks(params, leaf_delays(delay, params))
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


def run_or_pass(
    ready: chex.Array,
    run: Callable[[], tuple[optax.Updates, optax.OptState]],
    grads: optax.Updates,
    inner_state: optax.OptState,
) -> tuple[optax.Updates, optax.OptState]:
  """`run()` when `ready`, else SAPipe's "Pass": zero updates, state kept.

  Args:
    ready: a boolean scalar (may be traced).
    run: the optimizer call, returning its updates and new state.
    grads: a tree like the updates; a pass returns it times zero (in the
      updates' dtypes, shardings kept), which XLA writes in place where
      fresh zeros would be copied.
    inner_state: the optimizer state returned unchanged by a pass.

  Returns:
    The updates and the optimizer state.
  """
  def skip():
    shapes = jax.eval_shape(run)[0]
    return jax.tree.map(lambda g, s: (g * 0).astype(s.dtype), grads,
                        shapes), inner_state
  return jax.lax.cond(ready, run, skip)


class StaleOptimizerState(NamedTuple):
  """State of `stale_optimizer`."""

  stale: StaleGradientsState  # the gradients in flight.
  inner_state: optax.OptState  # the wrapped optimizer's state.


def stale_optimizer(
    optimizer: optax.GradientTransformation,
    delay: int,
    *,
    warmup: str = "skip",
) -> optax.GradientTransformationExtraArgs:
  r"""`optimizer` applied to gradients `delay` calls old, as SAPipe runs it.

  .. math::
    x_{t+1} = \begin{cases} x_t + \mathrm{opt}(g_{t-d}) & t \ge d \\
    x_t \ (\text{opt not called}) & t < d \end{cases}

  SAPipe's Algorithm 1 (and its code) "Pass"es on the first stale
  iteration: the optimizer does not run before a stale gradient exists, so
  its counters, moments and schedules start with the first real gradient and
  Adam's first update is exactly :math:`\eta\,\mathrm{sign}(g_0)`.
  `warmup="zeros"` instead feeds the zeros through the optimizer, which is
  `optax.chain(stale_gradients(delay), optimizer)` bit for bit (PipeSGD; the
  same for SGD with or without momentum, but Adam's first real update is
  then 0.744 lr after one zero step, and weight decay acts during warm-up).
  For partial staleness (stale and fresh leaves) wrap only the stale
  partition, e.g. `optax.partition({"stale": stale_optimizer(adam, 1),
  "fresh": adam}, labels)`: an optimizer's counters are shared by its leaves.

  Args:
    optimizer: the real optimizer; extra arguments (`stale_params=`) are
      passed to it.
    delay: :math:`d`, an int >= 0; 0 is `optimizer` itself.
    warmup: `"skip"` (SAPipe, the default here) or `"zeros"` (PipeSGD, what
      `stale_gradients` chained before an optimizer does).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = stale_optimizer(optax.adam(0.1), 1)
    >>> x = jnp.array(1.0)
    >>> state = opt.init(x)
    >>> steps = []
    >>> for g in [4.0, 4.0]:
    ...   updates, state = opt.update(jnp.asarray(g), state, x)
    ...   steps.append(round(float(updates), 4))
    >>> steps  # "Pass", then exactly -lr * sign(g_0)
    [0.0, -0.1]

  References:
    Chen et al, SAPipe (seed 004) Algorithm 1 ("Pass" at the first
    iteration), 2022; Li et al, `Pipe-SGD <https://arxiv.org/abs/1811.03619>`_,
    2018.
  """
  _check_delay(delay)
  if warmup not in WARMUPS:
    raise ValueError(f"warmup={warmup!r} is invalid; valid: {WARMUPS}")
  ring = stale_gradients(delay)
  inner = optax.with_extra_args_support(optimizer)

  def init_fn(params):
    return StaleOptimizerState(ring.init(params), inner.init(params))

  def update_fn(updates, state, params=None, **extra_args: Any):
    stale, ring_state = ring.update(updates, state.stale)

    def run():
      return inner.update(stale, state.inner_state, params, **extra_args)

    if warmup == "zeros" or delay == 0:
      step, inner_state = run()
    else:
      step, inner_state = run_or_pass(state.stale.count >= delay, run, stale,
                                      state.inner_state)
    return step, StaleOptimizerState(ring_state, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
