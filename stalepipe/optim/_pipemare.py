"""PipeMare: learning-rate rescheduling and discrepancy correction."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe.optim import _spectrain

COUNT_FROM = (1, 0)  # T1's step index at the first update: AsyncPP's, or 0


class PipeMareState(NamedTuple):
  """State of `PipeMare`."""

  count: chex.Array  # [] int32, update calls so far (saturating).
  inner_state: optax.OptState  # the wrapped optimizer's state.
  delta: optax.Updates  # like params (their dtypes): EMA of applied updates.


class PipeMare:
  r"""PipeMare's two techniques around any optax optimizer.

  T1, learning-rate rescheduling. At update :math:`t = 0, 1, \ldots` of a
  stage whose gradient has forward delay :math:`\tau` (the `staleness` extra
  argument: updates of this stage between the forward's read and this
  update), the inner optimizer's update is scaled by

  .. math::
    \tau^{-p_t}, \qquad p_t = 1 - \min\big((t + c) / K, 1\big)

  so the stage's step size is annealed from about :math:`\alpha / \tau` at
  the first update to :math:`\alpha` after :math:`K` (`warmup_steps`)
  updates. :math:`c` (`count_from`) is where the step index starts: 1 by
  default, as the official AsyncPP code's PipeMare correction counts
  (`adjust_learning_rate` divides the learning rate by
  `(num_versions - 1) ** (1 - min((1 + step + epoch * epoch_length) /
  (lr_correction_epoch * epoch_length), 1))`, so its first update already
  has :math:`p = 1 - 1/K`); `count_from=0` gives :math:`p_0 = 1`, exactly
  :math:`\alpha/\tau` at the first update.
  Scaling the update scales the learning rate of `optax.sgd` (with momentum)
  and `optax.adam(w)` exactly. :math:`\tau \le 1` or :math:`K = 0` leaves the
  update bit for bit unchanged.

  T2, discrepancy correction. With :math:`u_t` the update applied at call
  :math:`t` (after T1), the wrapper keeps

  .. math::
    \delta_{t+1} = \gamma\, \delta_t + (1 - \gamma)\, u_t, \qquad
    \delta_0 = 0

  (`decay` :math:`= \gamma`), an estimate of the weights' velocity, and a
  backward that reads the weights :math:`w` after :math:`b =
  \tau_\mathrm{fwd} - \tau_\mathrm{bkwd}` more updates than its forward did
  (`since_forward`) uses the weights extrapolated back to the forward's

  .. math::
    \hat w = w - b\, \delta

  `predict` returns :math:`\hat w`; a forward (:math:`b = 0`) gets :math:`w`
  bit for bit.

  State: the inner state, :math:`\delta` (params-sized, params' dtypes) and a
  step count.

  .. code-block:: python

    pm = sp.optim.PipeMare(optax.sgd(0.1, momentum=0.9), warmup_steps=2000,
                           decay=0.9)
    # A backward: its forward read this stage's weights 3 updates before the
    # minibatch's update (tau_fwd = 3), this read is 1 update before it
    # (tau_bkwd = 1), so the weights moved twice in between.
    w_hat = pm.predict(state, params, since_forward=2)
    grads = backward(w_hat, ...)
    updates, state = pm.update(grads, state, params, staleness=3)

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> pm = PipeMare(optax.sgd(1.0), warmup_steps=2, decay=0.5)
    >>> x = jnp.array([0.0])
    >>> state = pm.init(x)
    >>> for _ in range(3):  # scales 4^-0.5, 4^0, 4^0 (p = 1 - (t + 1) / 2)
    ...   updates, state = pm.update(jnp.array([-1.0]), state, x, staleness=4)
    ...   x = optax.apply_updates(x, updates)
    >>> float(x[0]), float(state.delta[0])  # 0.5 + 1 + 1
    (2.5, 0.8125)
    >>> float(pm.predict(state, x, since_forward=2)[0])  # 2.5 - 2 * 0.8125
    0.875

  References:
    Yang et al, `PipeMare: Asynchronous Pipeline Parallel DNN Training
    <https://arxiv.org/abs/1910.05124>`_, MLSys 2021 (techniques T1 and T2);
    T1's step count as in the official code of Ajanthan et al.,
    github.com/PluralisResearch/AsyncPP, `main_with_runtime.py` lines
    661-663 (`adjust_learning_rate`).
  """

  def __init__(
      self,
      optimizer: optax.GradientTransformation,
      *,
      warmup_steps: int,
      decay: float,
      count_from: int = 1,
  ):
    """Wraps `optimizer`.

    Args:
      optimizer: the real optimizer (e.g. `optax.sgd(lr, momentum)`).
      warmup_steps: :math:`K`, updates over which T1 anneals the step size
        from :math:`\\alpha/\\tau` to :math:`\\alpha`; 0 turns T1 off.
      decay: :math:`\\gamma \\in [0, 1)` of T2's moving average; 0 keeps only
        the last update.
      count_from: :math:`c`, T1's step index at the first update: 1 (the
        official AsyncPP code) or 0.
    """
    _spectrain.check_optimizer(optimizer)
    if (not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool)
        or warmup_steps < 0):
      raise ValueError(f"warmup_steps={warmup_steps!r} is invalid; valid: an "
                       "int >= 0")
    if (not isinstance(decay, (int, float)) or isinstance(decay, bool)
        or not 0 <= decay < 1):
      raise ValueError(f"decay={decay!r} is invalid; valid: a number in "
                       "[0, 1)")
    if isinstance(count_from, bool) or count_from not in COUNT_FROM:
      raise ValueError(f"count_from={count_from!r} is invalid; valid: "
                       f"{COUNT_FROM}")
    self._opt = optax.with_extra_args_support(optimizer)
    self._count_from = count_from
    self._warmup_steps = warmup_steps
    self._decay = float(decay)

  def _lr_scale(self, count: chex.Array, staleness: chex.Array) -> chex.Array:
    """T1's :math:`\\tau^{-p_t}`, float32; exactly 1 once :math:`p_t = 0`."""
    if not self._warmup_steps:
      return jnp.ones([], jnp.float32)
    t = count.astype(jnp.float32) + self._count_from
    power = 1 - jnp.minimum(t / self._warmup_steps, 1)
    tau = jnp.maximum(jnp.asarray(staleness, jnp.float32), 1)
    return jnp.where(power == 0, 1, tau ** -power)

  def init(self, params: optax.Params) -> PipeMareState:
    """The inner optimizer's state, :math:`\\delta = 0` and a zero count."""
    return PipeMareState(count=jnp.zeros([], jnp.int32),
                         inner_state=self._opt.init(params),
                         delta=optax.tree.zeros_like(params))

  def predict(self, state: PipeMareState, params: optax.Params, *,
              since_forward: chex.Numeric, **extra_args: Any) -> optax.Params:
    """T2's :math:`w - b\\,\\delta`, :math:`b` = `since_forward`.

    Args:
      state: the state (not changed).
      params: the current weights :math:`w`.
      since_forward: :math:`b = \\tau_\\mathrm{fwd} - \\tau_\\mathrm{bkwd}`,
        an integer scalar (may be traced); 0 for a forward.
      **extra_args: ignored (e.g. `ahead`).

    Returns:
      The corrected weights, in the params' dtypes.
    """
    del extra_args
    _spectrain.check_count("since_forward", since_forward)
    return jax.tree.map(
        lambda w, d: _spectrain.add_scaled(w, -since_forward, d), params,
        state.delta)

  def update(
      self,
      updates: optax.Updates,
      state: PipeMareState,
      params: Optional[optax.Params] = None,
      *,
      staleness: Optional[chex.Numeric] = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, PipeMareState]:
    """The inner update with T1's step size; folds it into :math:`\\delta`.

    Args:
      updates: the gradient.
      state: the state.
      params: the current params, if the inner optimizer needs them.
      staleness: :math:`\\tau`, the gradient's forward delay, an integer
        scalar (may be traced); required unless `warmup_steps=0`.
      **extra_args: passed to the inner optimizer, with `staleness`.

    Returns:
      The updates to apply and the new state.
    """
    if staleness is not None:
      _spectrain.check_count("staleness", staleness)
      extra_args["staleness"] = staleness
    elif self._warmup_steps:
      raise ValueError("staleness=None is invalid for PipeMare with "
                       f"warmup_steps={self._warmup_steps}; valid: an integer "
                       "scalar, the gradient's forward delay")
    step, inner_state = self._opt.update(updates, state.inner_state, params,
                                         **extra_args)
    scale = self._lr_scale(state.count, staleness)

    def rescale(u):
      acc = jnp.promote_types(u.dtype, jnp.float32)
      return (u.astype(acc) * scale.astype(acc)).astype(u.dtype)

    def average(d, u):
      acc = jnp.promote_types(d.dtype, jnp.float32)
      new = self._decay * d.astype(acc) + (1 - self._decay) * u.astype(acc)
      return new.astype(d.dtype)

    step = jax.tree.map(rescale, step)
    return step, PipeMareState(
        count=optax.safe_increment(state.count),
        inner_state=inner_state,
        delta=jax.tree.map(average, state.delta, step))

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as a transform (without `predict`)."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)

