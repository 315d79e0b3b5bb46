"""SpecTrain's weight prediction as an optimizer wrapper."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax


class SpecTrainState(NamedTuple):
  """State of `SpecTrain`."""

  inner_state: optax.OptState  # the wrapped optimizer's state.
  last: optax.Updates  # like params (their dtypes): the last update returned.


def check_optimizer(optimizer: Any) -> None:
  """Raises unless `optimizer` has optax's `init` and `update`."""
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise ValueError(f"optimizer={optimizer!r} is invalid; valid: an optax "
                     "GradientTransformation (with init and update)")


def check_count(name: str, value: Any) -> None:
  """Raises unless `value` is an integer scalar (traced values welcome)."""
  if (value is None or isinstance(value, bool) or jnp.ndim(value) != 0
      or not jnp.issubdtype(jnp.result_type(value), jnp.integer)):
    raise ValueError(f"{name}={value!r} is invalid; valid: an integer scalar "
                     "(Python int or int32 array, possibly traced)")


def add_scaled(x: chex.Array, count: chex.Array, step: chex.Array) -> chex.Array:
  """:math:`x + c \\cdot s` in at least float32, cast back; :math:`x` if c = 0."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  moved = (x.astype(acc) + jnp.asarray(count, acc) * step.astype(acc))
  # `where`, not the sum: x + 0 * s turns -0 into +0 and NaN-propagates s.
  return jnp.where(count == 0, x, moved.astype(x.dtype))


class SpecTrain:
  r"""SpecTrain's weight prediction: extrapolate the last update :math:`s` times.

  Wraps any optax optimizer. `update` is the inner optimizer's update; the
  wrapper keeps the last update :math:`u_t` it returned. `predict` gives the
  weights :math:`s` updates ahead, assuming each repeats the last one:

  .. math::
    \hat x = x + s\, u_t

  With `optax.sgd(lr, momentum=mu)` inside, :math:`u_t = -\eta\, b_t` with
  :math:`b_t = \mu\, b_{t-1} + g_t` the momentum buffer (optax's trace) after
  the last step, so :math:`\hat x = x - \eta\, s\, (\mu\, b_{t-1} + g_t)`:
  SpecTrain's prediction, the smoothed gradient times the version difference
  (`spectrain_prediction` is the same formula as a pure function). Before the
  first update :math:`u = 0` and :math:`\hat x = x`.

  In a pipeline, the staleness :math:`s` of a task on stage :math:`k` of
  :math:`N` is, with `staleness=`

  - `"pipeline"` (default, the paper's): one version for the whole
    minibatch, the weights every stage holds as its backward reaches stage
    0: :math:`s = \lfloor k/2 \rfloor + N - k - 1` for a forward and
    :math:`\lfloor k/2 \rfloor` for a backward, whatever the minibatch
    (`pipeline_ahead`, `stalepipe.schedules.Schedule.pipeline_ahead`). From
    the official code, ntueclab/SpecTrain-PyTorch `src/optimizer.py:304-306`
    (`load_predicted_weights`; the paper's text could not be found here).
    Defined on asynchronous 1F1B without weight stashing and one micro-batch
    per minibatch (`pipedream`, `weight_stashing=False`, M = 1); a pipeline
    refuses other schedules.
  - `"minibatch"`: each task predicts its own minibatch's update on its own
    stage: the updates the stage applies between the task's read and it
    (`ahead`, `Schedule.ahead`): :math:`N - 1 - k` for a forward and 0 for a
    backward once the pipeline is full, fewer while it fills; any schedule,
    any number of micro-batches. It differs from the paper's by
    :math:`\lfloor k/2 \rfloor` on stages :math:`k \ge 2`.

  `horizon_scale` :math:`c` multiplies the horizon, :math:`\hat x = x + c\,
  s\, u_t`: with `staleness="minibatch"` this is marin's `weight_pred`
  corrector (marin-community/marin, the delayed-gradient-pp experiment's
  `delay_optim.py`, lines 35-43 and 353-382: the gradient is taken at
  :math:`w + \tau c\, dW`, :math:`dW` the last applied update and
  :math:`\tau` the leaf's stage delay, `pred_scale` :math:`c = 1` by
  default, line 323), :math:`s` being that delay once the pipeline is
  full. marin evaluates the forward and the backward at once, at one
  prediction; here a backward reads its own prediction, from the state at
  its own time, as every `predict` in a pipeline does.

  `predict` with :math:`s = 0` returns the params bit for bit. State: the
  inner state plus one params-sized buffer. The official code reads the
  momentum buffer after the step (`src/optimizer.py:315-323`): its forward
  extrapolates :math:`\mu\, b_t + g_t` and its backward, after `zero_grad`,
  :math:`\mu\, b_t`; this wrapper uses, for both, the :math:`v_{t-1}` of
  its README's formula :math:`\hat W_{t+s} = W_t - s\, \eta\, v_{t-1}`
  (`doc/formula.svg`), the smoothed gradient of the last update.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> st = SpecTrain(optax.sgd(0.1, momentum=0.9))
    >>> x = jnp.array([1.0, -2.0])
    >>> state = st.init(x)
    >>> updates, state = st.update(jnp.array([1.0, 1.0]), state, x)
    >>> x = optax.apply_updates(x, updates)  # [0.9, -2.1]
    >>> [round(float(v), 4) for v in st.predict(state, x, pipeline_ahead=2)]
    [0.7, -2.3]

  References:
    Chen et al, `Efficient and Robust Parallel DNN Training through Model
    Parallelism on Multi-GPU Platform <https://arxiv.org/abs/1809.02839>`_
    (SpecTrain), 2018; official code
    `ntueclab/SpecTrain-PyTorch <https://github.com/ntueclab/SpecTrain-PyTorch>`_.
  """

  STALENESS = ("pipeline", "minibatch")  # the values `staleness` takes

  def __init__(self, optimizer: optax.GradientTransformation, *,
               staleness: str = "pipeline", horizon_scale: float = 1.0):
    """Wraps `optimizer` (e.g. `optax.sgd(lr, momentum=mu)`).

    Args:
      optimizer: the inner optax optimizer.
      staleness: "pipeline" (the paper's pipeline-wide version) or
        "minibatch" (each task to its own minibatch's update).
      horizon_scale: :math:`c >= 0`, the horizon's multiple of :math:`s`
        (marin's `pred_scale`); 1 is SpecTrain's.
    """
    check_optimizer(optimizer)
    if staleness not in self.STALENESS:
      raise ValueError(f"staleness={staleness!r} is invalid; valid: "
                       "'pipeline' (the paper's), 'minibatch'")
    if not horizon_scale >= 0:
      raise ValueError(f"horizon_scale={horizon_scale!r} is invalid; valid: "
                       "a number >= 0")
    self._opt = optax.with_extra_args_support(optimizer)
    self.staleness = staleness
    self.horizon_scale = horizon_scale

  def init(self, params: optax.Params) -> SpecTrainState:
    """The inner optimizer's state and a zero last update."""
    return SpecTrainState(inner_state=self._opt.init(params),
                          last=optax.tree.zeros_like(params))

  def predict(self, state: SpecTrainState, params: optax.Params, *,
              pipeline_ahead: Optional[chex.Numeric] = None,
              ahead: Optional[chex.Numeric] = None,
              **extra_args: Any) -> optax.Params:
    """:math:`x + c\\,s\\,u`; `state` is not changed.

    Args:
      state: the state.
      params: the current weights :math:`x`.
      pipeline_ahead: :math:`s` with `staleness="pipeline"`, an integer
        scalar (may be traced).
      ahead: :math:`s` with `staleness="minibatch"`, likewise.
      **extra_args: ignored (e.g. `since_forward`).

    Returns:
      The predicted weights, in the params' dtypes.
    """
    del extra_args
    name = "pipeline_ahead" if self.staleness == "pipeline" else "ahead"
    s = pipeline_ahead if self.staleness == "pipeline" else ahead
    check_count(name, s)
    c = self.horizon_scale
    if c != 1.0:
      return jax.tree.map(lambda x, u: add_scaled(x, s, c * u), params,
                          state.last)
    return jax.tree.map(lambda x, u: add_scaled(x, s, u), params, state.last)

  def update(
      self,
      updates: optax.Updates,
      state: SpecTrainState,
      params: Optional[optax.Params] = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, SpecTrainState]:
    """The inner optimizer's update, which is also kept for `predict`.

    Args:
      updates: the gradient.
      state: the state.
      params: the current params, if the inner optimizer needs them.
      **extra_args: passed to the inner optimizer (which ignores those it
        does not take).

    Returns:
      The updates to apply and the new state.
    """
    step, inner_state = self._opt.update(updates, state.inner_state, params,
                                         **extra_args)
    last = jax.tree.map(lambda u, old: u.astype(old.dtype), step, state.last)
    return step, SpecTrainState(inner_state=inner_state, last=last)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This wrapper as a transform (without `predict`)."""
    return optax.GradientTransformationExtraArgs(self.init, self.update)
