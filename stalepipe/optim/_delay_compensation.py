"""Delay compensation (DC-ASGD, SAPipe eq. 1): a first-order Taylor fix of a stale gradient."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe.optim import _buffers
from stalepipe.optim import _ordering

FORMS = ("diagonal", "full", "ema")
ADAPTIVE = (None, "ema", "current")


def _wide(x: chex.Array) -> chex.Array:
  """`x` in at least float32, so bfloat16 products and sums keep precision."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _inner(grads: optax.Updates, dx: optax.Updates) -> chex.Array:
  """:math:`\\langle g, \\Delta x \\rangle` over the pytree, in float32 or wider.

  A sum of products, not `vdot`: under Explicit sharding a dot product
  contracting a sharded axis has no defined output sharding, a sum does.
  """
  return sum(jnp.sum(_wide(g) * _wide(d))
             for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(dx)))


def check_form(form: str, adaptive: Optional[str]) -> None:
  """Raises a one-line ValueError for an unknown `form` or `adaptive`."""
  if form not in FORMS:
    raise ValueError(f"form={form!r} is invalid; valid: {FORMS}")
  if adaptive not in ADAPTIVE:
    raise ValueError(f"adaptive={adaptive!r} is invalid; valid: {ADAPTIVE}")
  if form == "ema" and adaptive is not None:
    raise ValueError(f"form='ema' with adaptive={adaptive!r} is invalid; "
                     "valid: adaptive=None")


def compensate(
    grads: optax.Updates,
    dx: optax.Updates,
    lam: chex.Numeric,
    *,
    form: str = "diagonal",
    adaptive: Optional[str] = None,
    eps: float = 1e-7,
    mean_square: Optional[optax.Updates] = None,
) -> optax.Updates:
  r"""Delay-compensates `grads` computed at `x_then` for use at `x_then + dx`.

  .. math::
    \mathrm{DC}_\lambda(g, \Delta x) = g + \lambda\, g \circ g \circ \Delta x
    \quad\text{(diagonal)}, \qquad
    g + \lambda\, g\, \langle g, \Delta x \rangle \quad\text{(full)}, \qquad
    g + \lambda\, MS \circ \Delta x \quad\text{(ema)}

  the full form being :math:`g + \lambda g g^\top \Delta x` without the
  matrix, its inner product taken over the whole pytree; the `"ema"` form
  (marin's `dc_asgd_ema`) reads the curvature :math:`g \circ g` from its
  EMA :math:`MS` (`mean_square`). Adaptive `lam`:
  `"ema"` divides it elementwise by :math:`\sqrt{MS + \epsilon}` (DC-ASGD-a,
  `mean_square` is :math:`MS`); `"current"` by :math:`\sqrt{g^2+\epsilon}`
  (diagonal) or :math:`\sqrt{\lVert g\rVert^2+\epsilon}` (full). With
  `lam == 0` the result is `grads`, bit for bit. Arithmetic is in at least
  float32; each leaf keeps its dtype.

  Args:
    grads: the stale gradient :math:`g`.
    dx: :math:`x_{now} - x_{then}`, same structure.
    lam: :math:`\lambda`, a scalar.
    form: `"diagonal"`, `"full"` or `"ema"`.
    adaptive: `None`, `"ema"` or `"current"` (`None` with `form="ema"`).
    eps: :math:`\epsilon` of the adaptive forms.
    mean_square: :math:`MS`, needed when `adaptive="ema"` or `form="ema"`.

  Returns:
    The compensated gradient.

  Examples:
    >>> import jax.numpy as jnp
    >>> g, dx = jnp.array([1., 2.]), jnp.array([0.5, 0.5])
    >>> [round(float(v), 4) for v in compensate(g, dx, 0.1)]  # g + .1 g^2 dx
    [1.05, 2.2]
    >>> [round(float(v), 4) for v in compensate(g, dx, 0.1, form="full")]
    [1.15, 2.3]

  References:
    Zheng et al, `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, 2017;
    Chen et al, SAPipe (seed 004) §3.2 eq. (1), 2022.
  """
  check_form(form, adaptive)
  if "ema" in (adaptive, form) and mean_square is None:
    raise ValueError("adaptive='ema' or form='ema' needs mean_square=; valid: "
                     "a pytree like grads")
  lam = jnp.asarray(lam)
  if form == "ema":
    lams = jax.tree.map(lambda ms: lam * _wide(ms), mean_square)
  elif adaptive == "ema":
    lams = jax.tree.map(lambda ms: lam / jnp.sqrt(_wide(ms) + eps), mean_square)
  elif adaptive == "current" and form == "diagonal":
    lams = jax.tree.map(lambda g: lam / jnp.sqrt(jnp.square(_wide(g)) + eps),
                        grads)
  elif adaptive == "current":
    norm_sq = optax.tree.norm(jax.tree.map(_wide, grads), squared=True)
    lams = jax.tree.map(lambda _: lam / jnp.sqrt(norm_sq + eps), grads)
  else:
    lams = jax.tree.map(lambda _: lam, grads)

  if form == "diagonal":
    def one(g, d, lam_g):
      g32 = _wide(g)
      return (g32 + lam_g * g32 * g32 * _wide(d)).astype(g.dtype)
  elif form == "ema":  # lam_g is lam * MS
    def one(g, d, lam_g):
      return (_wide(g) + lam_g * _wide(d)).astype(g.dtype)
  else:
    inner = _inner(grads, dx)

    def one(g, d, lam_g):
      del d
      return (_wide(g) + lam_g * inner * _wide(g)).astype(g.dtype)

  # `where` rather than `g + 0 * ...`: keeps -0.0 and survives 0 * inf.
  return jax.tree.map(lambda g, d, lg: jnp.where(lam == 0, g, one(g, d, lg)),
                      grads, dx, lams)


class DelayCompensationState(NamedTuple):
  """State of `delay_compensation`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  # Per leaf [delay, *leaf.shape], sharded like the leaf: the last params
  # seen; `optax.EmptyState()` when delay=0.
  history: optax.Params
  # Like params: the EMA of g*g when adaptive="ema" or form="ema", else
  # `optax.EmptyState()`.
  mean_square: optax.Updates


def delay_compensation(
    lam: chex.Numeric,
    *,
    form: str = "diagonal",
    delay: int = 1,
    adaptive: Optional[str] = None,
    eps: float = 1e-7,
    decay: float = 0.95,
) -> optax.GradientTransformationExtraArgs:
  r"""Compensates a gradient computed at `x_then` for being applied at `x_now`.

  With :math:`\Delta x = x_{now} - x_{then}`, :math:`x_{now}` the `params`
  argument and :math:`x_{then}` the extra argument `stale_params` when given,
  otherwise the params seen `delay` calls earlier:

  .. math::
    g \leftarrow g + \lambda\, g \circ g \circ \Delta x \ \text{(diagonal)},
    \qquad g \leftarrow g + \lambda\, \langle g, \Delta x\rangle\, g
    \ \text{(full, SAPipe eq. 1)},
    \qquad g \leftarrow g + \lambda\, MS \circ \Delta x \ \text{(ema)}

  `form="ema"` is marin's `dc_asgd_ema` corrector (`dc_asgd_ema`): the
  curvature
  :math:`g \circ g` replaced by its EMA :math:`MS \leftarrow \beta MS +
  (1-\beta) g^2`, updated with the current gradient first.
  `adaptive="ema"` (DC-ASGD-a) divides :math:`\lambda` elementwise by
  :math:`\sqrt{MS+\epsilon}`, :math:`MS \leftarrow \beta MS + (1-\beta) g^2`
  updated with the current gradient first (:math:`\beta` = `decay`);
  `adaptive="current"` divides by :math:`\sqrt{g^2+\epsilon}` (diagonal) or
  :math:`\sqrt{\lVert g\rVert^2+\epsilon}` (full). Before `delay` calls of
  history exist the gradient passes unchanged. `lam=0` reproduces the
  uncompensated run bit for bit.

  Args:
    lam: :math:`\lambda >= 0`; may be injected with `optax.inject_hyperparams`
      (pass `static_args=("delay",)` there).
    form: `"diagonal"`, `"full"` or `"ema"`; the full form never builds a
      matrix.
    delay: calls between the gradient's weights and now, used when
      `stale_params` is not given; `delay=0` keeps no history and then
      requires `stale_params`, except from a pipeline executor (which passes
      `staleness=` always and `stale_params=` only where its schedule makes
      gradients stale): there a gradient without `stale_params` was computed
      on `params`, and passes unchanged (:math:`\Delta x = 0`).
    adaptive: `None`, `"ema"` or `"current"`.
    eps: :math:`\epsilon` of the adaptive forms.
    decay: :math:`\beta` of the mean square :math:`MS` (`adaptive="ema"`,
      `form="ema"`).

  Returns:
    An `optax.GradientTransformationExtraArgs`; its update takes `params` and
    optionally `stale_params=`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import stalepipe as sp
    >>> opt = optax.chain(sp.optim.stale_gradients(1),
    ...                   sp.optim.delay_compensation(0.5),
    ...                   optax.sgd(0.1))
    >>> x = jnp.array([1.0, -2.0])
    >>> state = opt.init(x)
    >>> for _ in range(3):
    ...   updates, state = opt.update(2 * x, state, x)  # grad of |x|^2
    ...   x = optax.apply_updates(x, updates)
    >>> [round(float(v), 4) for v in x]
    [0.64, -1.52]

  References:
    Zheng et al, `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, 2017;
    Chen et al, SAPipe (seed 004) §3.2 eq. (1) and Algorithm 2, 2022.
  """
  check_form(form, adaptive)
  if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
    raise ValueError(f"delay={delay!r} is invalid; valid: an int >= 0")
  if isinstance(decay, (int, float)) and not 0.0 <= decay < 1.0:
    raise ValueError(f"decay={decay} is invalid; valid: 0 <= decay < 1")

  def init_fn(params):
    history = optax.EmptyState()
    if delay:
      history = _buffers.zeros_stacks(params, delay)
    mean_square = optax.EmptyState()
    if "ema" in (adaptive, form):
      mean_square = optax.tree.zeros_like(params)
    return DelayCompensationState(jnp.zeros([], jnp.int32), history, mean_square)

  def update_fn(updates, state, params=None, *, stale_params=None,
                **extra_args: Any):
    if params is None:
      raise ValueError("delay_compensation needs params=; valid: the params "
                       "the update will be applied to")
    if stale_params is None and delay == 0:
      if "staleness" not in extra_args:
        raise ValueError("delay_compensation(delay=0) got stale_params=None; "
                         "valid: pass stale_params= or use delay >= 1")
      stale_params = params  # the executor's contract: a fresh gradient
    del extra_args
    slot = 0 if delay <= 1 else state.count % delay  # static: in-place update
    if stale_params is None:
      then = jax.tree.map(lambda h: h[slot], state.history)
      ready = state.count >= delay
    else:
      then, ready = stale_params, True
    dx = jax.tree.map(lambda x, y: _wide(x) - _wide(y), params, then)

    mean_square = state.mean_square
    if "ema" in (adaptive, form):
      mean_square = jax.tree.map(
          lambda ms, g: (decay * _wide(ms) + (1 - decay) * jnp.square(_wide(g))
                         ).astype(ms.dtype), state.mean_square, updates)
    compensated = compensate(updates, dx, lam, form=form, adaptive=adaptive,
                             eps=eps, mean_square=mean_square)
    out = jax.tree.map(lambda g, c: jnp.where(ready, c, g), updates, compensated)
    history = state.history
    if delay:
      # After the last read of the old history (the inner product of the full
      # form, the compensated gradient of the diagonal one), so XLA updates
      # the donated history in place instead of copying it in and out.
      last_read = out if form != "full" else _inner(updates, dx)
      params = _ordering.computed_after(params, last_read)
      history = jax.tree.map(lambda h, x: h.at[slot].set(x.astype(h.dtype)),
                             state.history, params)
    return out, DelayCompensationState(
        optax.safe_increment(state.count), history, mean_square)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dc_asgd_ema(
    lam: chex.Numeric = 1.0,
    *,
    decay: float = 0.99,
    delay: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""marin's `dc_asgd_ema` corrector: DC-ASGD with its curvature from an EMA of :math:`g^2`.

  .. math::
    MS \leftarrow \beta\, MS + (1-\beta)\, g \circ g, \qquad
    g \leftarrow g + \lambda\, MS \circ (x_{now} - x_{then})

  with :math:`MS` updated by the stale gradient first and :math:`x_{then}`
  the weights it was computed on (`stale_params`, or the params `delay`
  calls earlier): `delay_compensation(lam, form="ema", decay=decay,
  delay=delay)` with marin's defaults, :math:`\lambda = 1`, :math:`\beta =
  0.99`. Unlike DC-ASGD-a (`adaptive="ema"`, which divides :math:`\lambda`
  by :math:`\sqrt{MS}`), the EMA replaces :math:`g \circ g` itself: "the
  same correction but with the diagonal curvature read from an EMA of the
  squared gradient (i.e. Adam/RMSProp's second moment)".

  Args:
    lam: :math:`\lambda`.
    decay: :math:`\beta`.
    delay: as `delay_compensation`'s; 0 (the default) takes `stale_params`
      from a pipeline executor, which passes each gradient's stash.

  Returns:
    An `optax.GradientTransformationExtraArgs`; its update takes `params` and
    `stale_params=`.

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = dc_asgd_ema(1.0, decay=0.5)
    >>> g, x, then = jnp.array([2.0]), jnp.array([1.0]), jnp.array([0.5])
    >>> out, _ = opt.update(g, opt.init(x), x, stale_params=then)
    >>> float(out[0])  # MS = 0.5 * 4 = 2; 2 + 1 * 2 * 0.5
    3.0

  References:
    marin-community/marin, the delayed-gradient-pp experiment's
    `delay_optim.py` (stored version of 19,272 characters): the corrector,
    lines 26-29 and 235-238; `v_ema` starts at zeros, line 222; the defaults
    `dc_lambda=1.0`, `dc_beta2=0.99`, lines 157-158 and 318-319; Zheng et
    al, `Asynchronous Stochastic Gradient Descent with Delay Compensation
    <https://arxiv.org/abs/1609.08326>`_, 2017.
  """
  return delay_compensation(lam, form="ema", decay=decay, delay=delay)
