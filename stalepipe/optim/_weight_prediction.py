"""Weight prediction: SAPipe Algorithm 3 (options 1-3) and SpecTrain."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe.optim import _buffers
from stalepipe.optim import _delay_compensation
from stalepipe.optim import _ordering
from stalepipe.optim import _stale

OPTIONS = (1, 2, 3)


class WeightPredictionState(NamedTuple):
  """State of `WeightPrediction`.

  Buffers are like the params (shape, dtype, sharding) on stale leaves and
  `optax.MaskedNode()` where they are not needed, as in `optax.masked`.
  """

  count: chex.Array  # [] int32, update calls so far (saturating).
  inner_state: optax.OptState  # the wrapped optimizer's state.
  in_flight: _stale.StaleGradientsState  # synced gradients not yet applied.
  others: optax.Updates  # option 3: G - l / n handed in at the last call.
  ahead: optax.Updates  # the look-ahead step x_hat - x (options 1-3).


class WeightPrediction:
  r"""An optimizer wrapper for SAPipe's 1-step stale pipeline with prediction.

  Each call applies the synchronised gradient handed in one call earlier
  (PipeSGD, as `stale_gradients(1)`) through the real optimizer, and runs that
  same optimizer one step further with a predicted gradient :math:`\hat g`,
  without committing its state: :math:`\hat x = x + \mathrm{opt.update}(\hat
  g, s, x)`, an estimate of the weights the next gradient will be applied to.
  `predict` hands :math:`\hat x` to the forward pass. With :math:`n` workers,
  at iteration :math:`t` (:math:`\ell` local, :math:`G` synchronised
  gradients):

  .. math::
    \hat g = \begin{cases}
      \ell_{t-1} & \text{option 1 (local)} \\
      G_{t-2} & \text{option 2 (latest synchronised)} \\
      \mathrm{DC}_\lambda(G_{t-2} - \ell_{t-2}/n,\ x_t - x_{t-1}) + \ell_{t-1}/n
        & \text{option 3}
    \end{cases}

  (SAPipe numbers iterations from 1 and calls :math:`\ell_{t-1}` its
  :math:`g_{i,t}`.) Before the first update :math:`\hat x = x`; gradients
  that do not exist yet are zeros. Option 3 with `lam=0` is option 3 without
  DC.

  Warm-up: at the first call no synchronised gradient has arrived, and
  SAPipe's Algorithms 1 and 3 "Pass": `warmup="skip"` (the default) does not
  call the optimizer then (no update; its counters and moments start with the
  first real gradient, so Adam's first real step is exactly
  :math:`\eta\,\mathrm{sign}(G_0)`), and the first look-ahead runs from the
  optimizer's initial state at :math:`x_0`. `warmup="zeros"` feeds the zero
  gradient through the optimizer instead, as `stale_gradients(1)` chained
  before it does (PipeSGD): the same for SGD with or without momentum, but
  Adam's first real step is then 0.744 lr and weight decay acts at the
  first call. With `mask`, only the masked leaves are stale and predicted (SAPipe
  applies both to the first k layers only); the others get the fresh
  synchronised gradient and :math:`\hat x = x`.

  Fused: `update` runs the look-ahead in the same pass as the real step and
  keeps only its result, the step :math:`\hat x - x`, so `predict` is one
  add. Option 3's :math:`x_t - x_{t-1}` is the update returned one call
  earlier, and the look-ahead runs at :math:`x_t` plus the update returned
  now: both are exact when the returned updates are applied as they are
  (`optax.apply_updates`, as below). If something else moves the params in
  between (e.g. a gossip average), :math:`\hat x` is those params plus the
  look-ahead step. State: the stale gradient and the look-ahead step, plus
  :math:`G - \ell/n` for option 3 (4 or 8 bytes per float32 parameter
  each); under `jax.jit` with the state donated, every buffer is updated in
  place (no copies; `tests/optim_buffers_test.py`).

  A data-parallel training step, run per worker (e.g. under `jax.vmap` or
  `shard_map` with axis name `"data"`):

  .. code-block:: python

    wp = sp.optim.WeightPrediction(optax.sgd(0.1, 0.9), option=3,
                                   num_workers=4, lam=0.2)

    def train_step(params, state, batch):
      x_hat = wp.predict(state, params)
      local = jax.grad(loss_fn)(x_hat, batch)
      synced = jax.lax.pmean(local, "data")
      updates, state = wp.update(synced, state, params, local_updates=local)
      return optax.apply_updates(params, updates), state

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> wp = WeightPrediction(optax.sgd(0.1), option=1)
    >>> x = jnp.array([1.0, -2.0])
    >>> state = wp.init(x)
    >>> for _ in range(3):
    ...   x_hat = wp.predict(state, x)
    ...   updates, state = wp.update(2 * x_hat, state, x)  # grad of |x|^2
    ...   x = optax.apply_updates(x, updates)
    >>> [round(float(v), 4) for v in x]
    [0.64, -1.28]

  References:
    Chen et al, SAPipe (seed 004) §3.2 and Algorithms 1 and 3, 2022.
  """

  def __init__(
      self,
      optimizer: optax.GradientTransformation,
      option: int,
      *,
      num_workers: int = 1,
      lam: chex.Numeric = 0.2,
      form: str = "full",
      adaptive: Optional[str] = None,
      eps: float = 1e-7,
      mask: Optional[Any] = None,
      warmup: str = "skip",
  ):
    """Wraps `optimizer`.

    Args:
      optimizer: the real optimizer (e.g. `optax.sgd(lr, momentum)`).
      option: SAPipe's option, 1, 2 or 3.
      num_workers: :math:`n`, data-parallel workers (option 3).
      lam: :math:`\\lambda` of option 3's delay compensation.
      form: `"full"` (SAPipe's choice) or `"diagonal"` DC in option 3.
      adaptive: `None` or `"current"` scaling of `lam` in option 3.
      eps: :math:`\\epsilon` of the adaptive form.
      mask: a pytree of bools like the params (or a callable returning one):
        the stale, predicted leaves; `None` makes every leaf stale.
      warmup: `"skip"` (SAPipe's "Pass" at the first call) or `"zeros"`
        (the zero gradient goes through the optimizer, PipeSGD). With fresh
        leaves in `mask` only `"zeros"` is valid: one optimizer's counters
        are shared by all its leaves, and the fresh ones have a gradient.
    """
    if option not in OPTIONS:
      raise ValueError(f"option={option!r} is invalid; valid: {OPTIONS}")
    if not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"num_workers={num_workers!r} is invalid; valid: an "
                       "int >= 1")
    _delay_compensation.check_form(form, adaptive)
    if adaptive == "ema":
      raise ValueError("adaptive='ema' is invalid here; valid: None or "
                       "'current'")
    if form == "ema":
      raise ValueError("form='ema' is invalid here; valid: 'full' or "
                       "'diagonal'")
    if warmup not in _stale.WARMUPS:
      raise ValueError(f"warmup={warmup!r} is invalid; valid: "
                       f"{_stale.WARMUPS}")
    self._opt = optax.with_extra_args_support(optimizer)
    self._warmup = warmup
    self._option = option
    self._num_workers = num_workers
    self._dc = dict(lam=lam, form=form, adaptive=adaptive, eps=eps)
    self._mask = mask

  @property
  def num_workers(self) -> int:
    """:math:`n`, the data-parallel workers whose gradients are averaged."""
    return self._num_workers

  def _stale_mask(self, tree):
    if self._mask is None:
      return jax.tree.map(lambda _: True, tree)
    return self._mask(tree) if callable(self._mask) else self._mask

  def _keep(self, tree, needed=True):
    """`tree` on stale leaves when this option needs it, else absent."""
    def one(stale, x):
      return x if needed and stale else _buffers.absent()
    return jax.tree.map(one, self._stale_mask(tree), tree)

  def _others(self, synced, local):
    """Option 3's :math:`G - \\ell / n` on stale leaves, absent elsewhere."""
    n = self._num_workers
    return self._keep(jax.tree.map(lambda g, l: g - l / n, synced, local),
                      self._option == 3)

  def init(self, params: optax.Params) -> WeightPredictionState:
    """The wrapper's buffers (zeros) and the inner optimizer's state."""
    # Fresh buffers per field (no aliasing of params), so states can be donated.
    zeros = lambda: optax.tree.zeros_like(params)  # pylint: disable=unnecessary-lambda-assignment
    delays = jax.tree.map(int, self._stale_mask(params))
    if self._warmup == "skip" and not all(jax.tree.leaves(delays)):
      raise ValueError("warmup='skip' with fresh leaves in mask is invalid; "
                       "valid: warmup='zeros' (or no mask)")
    return WeightPredictionState(
        count=jnp.zeros([], jnp.int32),
        inner_state=self._opt.init(params),
        in_flight=_stale.stale_gradients(delays).init(params),
        others=self._others(zeros(), zeros()),
        ahead=self._keep(zeros()))

  def predict(self, state: WeightPredictionState, params: optax.Params,
              **pipeline_args: Any) -> optax.Params:
    """The predicted weights :math:`\\hat x`; `state` is not changed.

    SAPipe predicts one step ahead whatever the pipeline's schedule, so the
    pipeline's `ahead` and `since_forward` (`stalepipe.pipeline.contract`)
    are accepted and not used.
    """
    del pipeline_args
    started = state.count > 0

    def one(stale, x, step):
      if not stale:
        return x
      return jnp.where(started, optax.apply_updates(x, step), x)
    return jax.tree.map(one, self._stale_mask(params), params, state.ahead)

  def update(
      self,
      updates: optax.Updates,
      state: WeightPredictionState,
      params: Optional[optax.Params] = None,
      *,
      local_updates: Optional[optax.Updates] = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, WeightPredictionState]:
    """Applies the gradient synchronised last call; looks one step ahead.

    Args:
      updates: this call's synchronised gradient :math:`G_t`.
      state: the state.
      params: the current params :math:`x_t`, if the optimizer needs them.
      local_updates: this worker's own gradient :math:`\\ell_t`; defaults to
        `updates` (a single worker).
      **extra_args: passed to the wrapped optimizer (both steps).

    Returns:
      The updates to apply and the new state.
    """
    local = updates if local_updates is None else local_updates
    stale = self._stale_mask(updates)
    ring = _stale.stale_gradients(jax.tree.map(int, stale))
    # Read the ring directly, not through `ring.update`: its output is ordered
    # after this call's gradient, which here would only add a reduction over
    # it (measured: +2 points of a batch-512 step); ordering on `ahead` below
    # does the same job.
    applied = jax.tree.map(lambda s, g, b: b[0].astype(g.dtype) if s else g,
                           stale, updates, state.in_flight.buffer)
    if self._option == 2:  # so that `ahead` depends on this call's gradient
      applied = _ordering.computed_after(applied, updates)
    def run():
      return self._opt.update(applied, state.inner_state, params, **extra_args)

    if self._warmup == "zeros":
      step, inner_state = run()
    else:
      step, inner_state = _stale.run_or_pass(state.count > 0, run, applied,
                                             state.inner_state)
    if self._option == 1:
      g_hat = local
    elif self._option == 2:
      g_hat = applied
    else:
      n = self._num_workers
      compensated = _delay_compensation.compensate(
          state.others, self._keep(step), **self._dc)
      g_hat = jax.tree.map(lambda c, l: c + l / n, compensated,
                           self._keep(local))
    g_hat = jax.tree.map(
        lambda s, g, x: g.astype(x.dtype) if s else jnp.zeros_like(x),
        stale, g_hat, updates)
    x_next = None if params is None else optax.apply_updates(params, step)
    ahead, _ = self._opt.update(g_hat, inner_state, x_next, **extra_args)
    ahead = self._keep(ahead)
    # `ahead` is computed after the last reads of the old stale gradient,
    # `others`, `ahead` (by `predict`, which the forward pass behind this
    # call's gradient needed) and params: writing the new ones after it lets
    # XLA update all of them in place instead of copying each in and out.
    updates, local = _ordering.computed_after((updates, local), ahead)
    step = _ordering.computed_after(step, ahead)
    _, in_flight = ring.update(updates, state.in_flight)
    return step, WeightPredictionState(
        count=optax.safe_increment(state.count),
        inner_state=inner_state,
        in_flight=in_flight,
        others=self._others(updates, local),
        ahead=ahead)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as a transform; its update takes `local_updates=`."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)


def spectrain_prediction(
    params: optax.Params,
    grads: optax.Updates,
    momentum_buffer: Optional[optax.Updates],
    *,
    learning_rate: chex.Numeric,
    staleness: chex.Numeric,
    momentum: chex.Numeric = 0.9,
) -> optax.Params:
  r"""SpecTrain's prediction of the weights `staleness` updates ahead.

  .. math::
    \hat x = x - \eta\, s\, (\mu\, b + g)

  the next momentum-SGD step (:math:`b` the momentum buffer, i.e. the `trace`
  of `optax.sgd(lr, momentum)`: `optax.tree.get(opt_state, "trace")`)
  extrapolated over the staleness :math:`s` of the stage and pass.

  Args:
    params: :math:`x`.
    grads: the latest gradient :math:`g`.
    momentum_buffer: :math:`b`, or `None` for plain SGD (:math:`b = 0`).
    learning_rate: :math:`\eta`.
    staleness: :math:`s`, a scalar or a pytree of scalars like `params` (one
      per stage).
    momentum: :math:`\mu`.

  Returns:
    :math:`\hat x`, in the params' dtypes.

  Examples:
    >>> import jax.numpy as jnp
    >>> x_hat = spectrain_prediction(jnp.array(1.0), jnp.array(0.5),
    ...                              jnp.array(1.0), learning_rate=0.1,
    ...                              staleness=2, momentum=0.9)
    >>> round(float(x_hat), 4)  # 1 - 0.1 * 2 * (0.9 * 1 + 0.5)
    0.72

  References:
    Chen et al, `Efficient and Robust Parallel DNN Training through Model
    Parallelism on Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_
    (SpecTrain), 2018; SAPipe (seed 004) §6 cites it as [5].
  """
  if momentum_buffer is None:
    momentum_buffer = optax.tree.zeros_like(grads)
  if not isinstance(staleness, (int, float)) and jax.tree.structure(
      staleness) == jax.tree.structure(params):
    s_tree = staleness
  else:
    s_tree = jax.tree.map(lambda _: staleness, params)
  return jax.tree.map(
      lambda x, g, b, s: (x - learning_rate * s * (momentum * b + g)).astype(
          jnp.asarray(x).dtype),
      params, grads, momentum_buffer, s_tree)
