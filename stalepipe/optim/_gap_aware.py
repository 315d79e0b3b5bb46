"""Gap-Aware (Barkai et al., ICLR 2020): a stale gradient divided by how far the weights moved since it was computed."""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

FORMS = ("adam", "sgd")


def _wide(x: chex.Array) -> chex.Array:
  """`x` in at least float32."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class GapAwareState(NamedTuple):
  """State of `gap_aware`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  # [] float32 (float64 with x64 on), the largest learning rate seen so far.
  max_lr: chex.Array
  # Like params: form="sgd", the EMA of the squared momentum buffer (or of
  # g*g without momentum); form="adam", the EMA of the squared Adam step.
  step_sq: optax.Updates
  # Like params: the optimizer's first moment (SGD's momentum buffer, Adam's
  # m) of the gradients this transform emits; `optax.EmptyState()` for SGD
  # without momentum.
  trace: optax.Updates
  # Like params: Adam's second moment v; `optax.EmptyState()` for SGD.
  nu: optax.Updates


def gap_aware(
    learning_rate: optax.ScalarOrSchedule,
    *,
    form: str = "adam",
    momentum: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    big_gamma: float = 0.999,
) -> optax.GradientTransformationExtraArgs:
  r"""Divides a stale gradient by the gap, the distance the weights moved, in average steps.

  FTPipe's Gap-Aware as its code runs it (`apply_on_theta`, weight stashing:
  the gradient was computed on the stashed weights :math:`\theta_{stash}`,
  the extra argument `stale_params`, and is applied at the current weights
  :math:`\theta`, the `params` argument):

  .. math::
    \phi = 1 + \frac{\lvert \theta - \theta_{stash} \rvert}{C}, \qquad
    g \leftarrow g / \phi

  elementwise, :math:`C` the size of an average step of the optimizer this
  transform is chained before:

  - `form="adam"` (`adam_gap_aware.py` lines 185-197 and
    `adamw_gap_aware.py` lines 135-144, with the step recorded by
    `optimizers/adam_record.py` lines 107-140 / `adamw_record.py` lines
    97-125): :math:`C = \sqrt{s} + \epsilon`, :math:`s` the EMA with
    :math:`\beta_2` of the squared Adam step
    :math:`\eta_t \hat m_t / (\sqrt{\hat v_t} + \epsilon)` of the previous
    calls (no bias correction, 0 at the first call);
  - `form="sgd"` (`sgd_gap_aware.py` lines 120-140 and 178-204):
    :math:`C = \eta_{max} (\sqrt{r / (1 - \gamma^t)} + \epsilon)`,
    :math:`r \leftarrow \gamma r + (1-\gamma) b^2` with :math:`b` SGD's
    momentum buffer before this call's step (or :math:`r \leftarrow \gamma r
    + (1-\gamma) g^2` without momentum), :math:`t = 1, 2, \ldots` and
    :math:`\eta_{max}` the largest learning rate so far (`interface.py`
    lines 74-81 and 115-128).

  The transform keeps the moments itself, of the gradients it emits, so they
  are those of the optimizer after it when that optimizer is
  `optax.adam(learning_rate, b1, b2, eps)` (`form="adam"`) or
  `optax.sgd(learning_rate, momentum)` (`form="sgd"`) with the same
  arguments (a config gives it the optimizer's, `optim.MIRRORS`). Where a
  gradient is fresh (:math:`\theta_{stash} = \theta`, or
  no `stale_params` from a pipeline executor) :math:`\phi = 1` and the
  gradient passes unchanged; the statistics are updated at every call, as
  FTPipe's optimizer records every step. A learning rate of 0 leaves the
  gradient unchanged (`sgd_gap_aware.py` line 186).

  Weight decay: FTPipe divides the L2 term by :math:`\phi` too
  (`sgd_gap_aware.py` lines 205-219; `adam_gap_aware.py` lines 198-214),
  which is what a config's `weight_decay_mode="l2"` does (its decay joins the
  gradient before this transform, `optim.DIRECTIONS`). For AdamW it also
  shrinks the decoupled decay to :math:`\eta\lambda\theta/\phi`
  (`adamw_gap_aware.py` lines 145-164), which a transform before the
  optimizer cannot do: with `weight_decay_mode="decoupled"` the decay is
  not divided by :math:`\phi`. Without momentum, `form="sgd"` averages the
  squared gradient it receives, L2 term included; FTPipe's excludes it.

  Args:
    learning_rate: :math:`\eta_t` of the optimizer after it, a number or an
      optax schedule.
    form: `"adam"` (FTPipe's `adam`/`adamw` Gap-Aware) or `"sgd"` (its
      `sgd1`).
    momentum: SGD's momentum (`form="sgd"`).
    b1: Adam's :math:`\beta_1` (`form="adam"`).
    b2: Adam's :math:`\beta_2`, also the decay of the step average.
    eps: :math:`\epsilon`: Adam's (`form="adam"`), or Gap-Aware's own
      (`form="sgd"`, FTPipe's `epsilon=1e-8`).
    big_gamma: :math:`\gamma` of the `form="sgd"` average (0.999 in FTPipe).

  Returns:
    An `optax.GradientTransformationExtraArgs`; its update takes `params` and
    `stale_params=`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> ga = gap_aware(0.1, form="sgd")
    >>> state = ga.init(jnp.zeros(2))
    >>> g = jnp.array([1.0, -2.0])
    >>> _, state = ga.update(g, state, jnp.zeros(2), stale_params=jnp.zeros(2))
    >>> out, _ = ga.update(g, state, jnp.array([0.1, 0.4]),
    ...                    stale_params=jnp.zeros(2))
    >>> # C = 0.1 * (|g| + 1e-8): one step; moved 1 and 2 steps -> phi = 2, 3
    >>> [round(float(v), 4) for v in out]
    [0.5, -0.6667]

  References:
    Barkai et al, `Gap-Aware Mitigation of Gradient Staleness
    <https://arxiv.org/abs/1909.10802>`_, ICLR 2020; Eliad et al, FTPipe
    (github.com/saareliad/FTPipe, `pipe/pipeline/gap_aware/`, with
    `pipe/prepare_pipeline.py` lines 158-180 and 376-379 choosing the class
    and the step-recording optimizer).
  """
  if form not in FORMS:
    raise ValueError(f"form={form!r} is invalid; valid: {FORMS}")
  for name, value in (("b1", b1), ("b2", b2), ("big_gamma", big_gamma),
                      ("momentum", momentum)):
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{name}={value} is invalid; valid: 0 <= {name} < 1")
  adam = form == "adam"
  has_trace = adam or momentum != 0.0

  def init_fn(params):
    zeros = lambda: optax.tree.zeros_like(params)  # pylint: disable=unnecessary-lambda-assignment
    return GapAwareState(
        count=jnp.zeros([], jnp.int32), max_lr=jnp.zeros([], float),
        step_sq=zeros(), trace=zeros() if has_trace else optax.EmptyState(),
        nu=zeros() if adam else optax.EmptyState())

  def update_fn(updates, state, params=None, *, stale_params=None,
                **extra_args: Any):
    if params is None:
      raise ValueError("gap_aware needs params=; valid: the params the update "
                       "will be applied to")
    if stale_params is None:
      if "staleness" not in extra_args:
        raise ValueError("gap_aware got stale_params=None; valid: the params "
                         "the gradient was computed on")
      stale_params = params  # the executor's contract: a fresh gradient
    del extra_args
    lr = learning_rate(state.count) if callable(learning_rate) else (
        learning_rate)
    max_lr = jnp.maximum(state.max_lr, lr).astype(state.max_lr.dtype)
    count = optax.safe_increment(state.count)
    t = count.astype(state.max_lr.dtype)
    gaps = jax.tree.map(lambda x, y: jnp.abs(_wide(x) - _wide(y)), params,
                        stale_params)

    if adam:
      steps = jax.tree.map(lambda s: jnp.sqrt(_wide(s)) + eps, state.step_sq)
      step_sq = state.step_sq
    else:
      seen = state.trace if has_trace else updates
      step_sq = jax.tree.map(
          lambda r, b: big_gamma * _wide(r) + (1 - big_gamma) * jnp.square(
              _wide(b)), state.step_sq, seen)
      bias = 1.0 - big_gamma ** t
      steps = jax.tree.map(lambda r: max_lr * (jnp.sqrt(r / bias) + eps),
                           step_sq)

    def divide(g, gap, c):
      return jnp.where(max_lr > 0, _wide(g) / (1.0 + gap / c), _wide(g))
    out = jax.tree.map(divide, updates, gaps, steps)

    trace, nu = state.trace, state.nu
    if adam:
      trace = jax.tree.map(lambda m, g: b1 * _wide(m) + (1 - b1) * g,
                           state.trace, out)
      nu = jax.tree.map(lambda v, g: b2 * _wide(v) + (1 - b2) * g * g,
                        state.nu, out)
      step_size = lr / (1.0 - b1 ** t)
      root_bias = jnp.sqrt(1.0 - b2 ** t)
      step_sq = jax.tree.map(
          lambda s, m, v: b2 * _wide(s) + (1 - b2) * jnp.square(
              step_size * m / (jnp.sqrt(v) / root_bias + eps)),
          state.step_sq, trace, nu)
    elif has_trace:
      trace = jax.tree.map(lambda b, g: momentum * _wide(b) + g, state.trace,
                           out)
    cast = lambda tree: optax.tree.cast_like(tree, state.step_sq)  # pylint: disable=unnecessary-lambda-assignment
    out = jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)
    return out, GapAwareState(
        count=count, max_lr=max_lr, step_sq=cast(step_sq),
        trace=cast(trace) if has_trace else trace,
        nu=cast(nu) if adam else nu)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
