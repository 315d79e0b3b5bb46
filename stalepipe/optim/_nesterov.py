"""Nesterov momentum for asynchronous pipelines (Ajanthan et al., ICML 2025), as its code runs it."""

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

LIMIT_MOMENTUM = 0.99  # the delay-aware momentum's limit in the authors' code


class ScaleByAsyncNesterovState(NamedTuple):
  """State of `scale_by_async_nesterov`."""

  count: chex.Array  # [] int32, calls so far (saturating).
  mu_product: chex.Array  # [] float32, the product of mu_1..mu_t.
  mu: optax.Updates  # like params: EMA of g with b1.
  nu: optax.Updates  # like params: EMA of g*g with b2.


def delay_aware_momentum(b1: float, delay: int, num_stages: int) -> float:
  r"""The first-moment decay raised with the stage's delay.

  .. math::
    \beta_1(\tau) = \beta_1 + \tau\, \frac{0.99 - \beta_1}{S}

  with :math:`\tau` the stage's delay (its weight versions minus one) and
  :math:`S` the number of stages: the authors' `--adaptive_momentum`
  (github.com/PluralisResearch/AsyncPP, `main_with_runtime.py` lines
  328-330; an option, off in their `run.bash`).

  Args:
    b1: :math:`\beta_1` without delay.
    delay: :math:`\tau >= 0`.
    num_stages: :math:`S >= 1`.

  Returns:
    :math:`\beta_1(\tau)`.

  Examples:
    >>> round(delay_aware_momentum(0.9, 3, 4), 4)
    0.9675
  """
  if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
    raise ValueError(f"delay={delay!r} is invalid; valid: an int >= 0")
  if isinstance(num_stages, bool) or not isinstance(num_stages, int) or (
      num_stages < 1):
    raise ValueError(f"num_stages={num_stages!r} is invalid; valid: an int "
                     ">= 1")
  return b1 + delay * (LIMIT_MOMENTUM - b1) / num_stages


def scale_by_async_nesterov(
    b1: float = LIMIT_MOMENTUM,
    b2: float = 0.999,
    eps: float = 1e-8,
    momentum_decay: float = 0.004,
    *,
    delay: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> optax.GradientTransformation:
  r"""Nesterov-accelerated Adam with a high, optionally delay-aware momentum.

  The update the official code of Ajanthan et al.
  (github.com/PluralisResearch/AsyncPP) runs for its method: `run.bash`
  line 17 trains with `--momentum 0.99 --optimizer nadamw` on PipeDream's
  asynchronous schedule with weight stashing, which builds `torch.optim.NAdam`
  with betas `(0.99, 0.999)`, `momentum_decay` 0.004, eps 1e-8 and decoupled
  weight decay (`main_with_runtime.py` lines 62-68 and 342-352,
  `optim/nadamw.py` lines 12-25, `optim/optimizer.py` lines 48-49): NAdam
  (Dozat, 2016, in PyTorch's form) with :math:`\beta_1` = 0.99. With
  :math:`t = 1, 2, \ldots` and :math:`\psi` = `momentum_decay`:

  .. math::
    \mu_t = \beta_1 (1 - \tfrac12 \cdot 0.96^{t\psi}), \quad
    \Pi_t = \textstyle\prod_{i \le t} \mu_i, \quad
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,

    u_t = \frac{1-\mu_t}{1-\Pi_t} \frac{g_t}{d_t}
        + \frac{\mu_{t+1}}{1-\Pi_t \mu_{t+1}} \frac{m_t}{d_t}, \qquad
    d_t = \sqrt{v_t / (1-\beta_2^t)} + \epsilon .

  The look-ahead term :math:`\mu_{t+1} m_t` steps along the momentum, which
  is where the paper corrects for the delay; with `delay` and `num_stages`
  given, :math:`\beta_1` is raised with the stage's delay
  (`delay_aware_momentum`, the code's `--adaptive_momentum`). Chain it after
  the stale gradients and before `optax.scale_by_learning_rate(lr)`. The
  official configuration in full is
  `optax.chain(optax.clip_by_global_norm(10.0), scale_by_async_nesterov(),
  optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(lr))` per
  stage (`run.bash` line 12 clips each stage's gradient at 10,
  `optim/optimizer.py` line 197; the weight decay default 0.01 is
  `main_with_runtime.py` line 68; PyTorch's decoupled decay
  :math:`x \leftarrow x (1 - \eta w)` before the step is the same as
  `add_decayed_weights` before the learning rate); in a config,
  `weight_decay_mode="decoupled"` and `grad_clip_norm=10.0`.

  The paper's own equations (its modified look-ahead step and the fixed-delay
  analysis) could not be read with the search tools: only its abstract, a
  blog introduction, a reproducibility summary saying that the paper relies
  on PyTorch's NAdam implementation, and the official code were reachable.
  This transform is therefore the code's update, not a transcription of the
  paper's equations; where those differ from PyTorch's NAdam is not known.

  Args:
    b1: :math:`\beta_1` (0.99 in the authors' runs).
    b2: :math:`\beta_2`.
    eps: :math:`\epsilon`, added after the square root.
    momentum_decay: :math:`\psi` of the :math:`\mu_t` schedule.
    delay: the stage's delay :math:`\tau`, for the delay-aware momentum.
    num_stages: the number of stages :math:`S`, with `delay`.

  Returns:
    An `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(scale_by_async_nesterov(),
    ...                   optax.scale_by_learning_rate(1e-3))
    >>> state = opt.init(jnp.zeros(2))
    >>> updates, state = opt.update(jnp.array([1., -2.]), state)
    >>> # first step: -lr sign(g) (1 + mu_2 (1 - b1) / (1 - mu_1 mu_2))
    >>> [round(float(v), 7) for v in updates]
    [-0.0010066, 0.0010066]

  References:
    Ajanthan et al, `Nesterov Method for Asynchronous Pipeline Parallel
    Optimization <https://arxiv.org/abs/2505.01099>`_, ICML 2025, and its
    official code (github.com/PluralisResearch/AsyncPP: `run.bash`,
    `main_with_runtime.py`, `optim/nadamw.py`); Dozat, `Incorporating
    Nesterov Momentum into Adam
    <https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
  """
  if (delay is None) != (num_stages is None):
    raise ValueError(f"delay={delay!r} with num_stages={num_stages!r} is "
                     "invalid; valid: both given or both None")
  if delay is not None:
    b1 = delay_aware_momentum(b1, delay, num_stages)
  if not 0.0 <= b1 < 1.0:
    raise ValueError(f"b1={b1} is invalid; valid: 0 <= b1 < 1")

  def init_fn(params):
    return ScaleByAsyncNesterovState(
        count=jnp.zeros([], jnp.int32), mu_product=jnp.ones([], jnp.float32),
        mu=optax.tree.zeros_like(params), nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    mu_t = b1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1.0) * momentum_decay))
    mu_product = state.mu_product * mu_t
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    grad_scale = (1.0 - mu_t) / (1.0 - mu_product)
    mu_scale = mu_next / (1.0 - mu_product * mu_next)

    def step(g, m, v):
      d = jnp.sqrt(v) + eps
      return (grad_scale * g / d + mu_scale * m / d).astype(g.dtype)

    out = jax.tree.map(step, updates, mu, nu_hat)
    cast = lambda t: optax.tree.cast_like(t, state.mu)  # pylint: disable=unnecessary-lambda-assignment
    return out, ScaleByAsyncNesterovState(count, mu_product, cast(mu),
                                          cast(nu))

  return optax.GradientTransformation(init_fn, update_fn)
