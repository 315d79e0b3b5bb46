"""stale_optimizer's warm-up, scale_by_staleness's tree matching, the async Nesterov update: against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict

import stalepipe as sp


def _adam_first_update(lr, g, zero_steps, b1=0.9, b2=0.999, eps=1e-8):
  """NumPy Adam: `zero_steps` zero gradients, then g; the update of g."""
  m = v = 0.0
  for t, grad in enumerate([0.0] * zero_steps + [g], start=1):
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad**2
  return -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)


@pytest.mark.parametrize("delay", [1, 2])
def test_skip_warmup_gives_adams_exact_first_step_and_zeros_shift_it(delay):
  lr, g = 0.1, 3.0
  x = jnp.zeros(())
  firsts = {}
  for warmup in ("skip", "zeros"):
    opt = sp.optim.stale_optimizer(optax.adam(lr), delay, warmup=warmup)
    state, update = opt.init(x), jax.jit(opt.update)
    outs = []
    for _ in range(delay + 1):
      u, state = update(jnp.asarray(g), state, x)
      outs.append(float(u))
    assert outs[:delay] == [0.0] * delay
    firsts[warmup] = outs[delay]
  # float32 bias corrections (1 - 0.999**t): 3e-5
  np.testing.assert_allclose(firsts["skip"], _adam_first_update(lr, g, 0),
                             rtol=3e-5)
  np.testing.assert_allclose(firsts["zeros"],
                             _adam_first_update(lr, g, delay), rtol=3e-5)
  if delay == 1:  # the figure: 0.744 lr
    assert round(-firsts["zeros"] / lr, 3) == 0.744


def test_zeros_warmup_is_the_chain_bit_for_bit():
  rng = np.random.default_rng(0)
  grads = [jnp.asarray(rng.normal(size=(3,)), jnp.float32) for _ in range(6)]
  wrapped = sp.optim.stale_optimizer(optax.adamw(0.1, weight_decay=0.1), 2,
                                     warmup="zeros")
  chained = optax.chain(sp.optim.stale_gradients(2),
                        optax.adamw(0.1, weight_decay=0.1))
  x = jnp.ones(3)
  sw, sc = wrapped.init(x), chained.init(x)
  for g in grads:
    uw, sw = wrapped.update(g, sw, x)
    uc, sc = chained.update(g, sc, x)
    np.testing.assert_array_equal(uw, uc)


def test_skip_warmup_then_matches_adam_on_the_delayed_gradients():
  rng = np.random.default_rng(1)
  grads = [jnp.asarray(rng.normal(size=(4,)), jnp.float32) for _ in range(7)]
  opt = sp.optim.stale_optimizer(optax.adam(0.05), 2)
  ref = optax.adam(0.05)
  x = jnp.zeros(4)
  state, ref_state = opt.init(x), ref.init(x)
  for t, g in enumerate(grads):
    u, state = jax.jit(opt.update)(g, state, x)
    if t >= 2:
      want, ref_state = ref.update(grads[t - 2], ref_state, x)
      np.testing.assert_allclose(u, want, rtol=1e-6)


@pytest.mark.parametrize("bad", [{"delay": -1}, {"delay": 1, "warmup": "no"}])
def test_stale_optimizer_rejects_bad_input(bad):
  with pytest.raises(ValueError, match="is invalid; valid:"):
    sp.optim.stale_optimizer(optax.sgd(0.1), **bad)


def _stages():
  return {"s0": {"w": jnp.ones(2)}, "s1": {"w": jnp.ones(3), "b": jnp.ones(1)}}


@pytest.mark.parametrize("container", [dict, nnx.State, FrozenDict])
def test_staleness_matches_by_key_prefix_for_any_dict_container(container):
  updates = container(_stages())
  opt = sp.optim.scale_by_staleness()
  out, _ = jax.jit(lambda u, s: opt.update(u, opt.init(u), staleness=s))(
      updates, {"s0": 2, "s1": {"w": 4, "b": 0}})
  assert type(out) is type(updates)
  np.testing.assert_array_equal(out["s0"]["w"], [0.5, 0.5])
  np.testing.assert_array_equal(out["s1"]["w"], [0.25] * 3)
  np.testing.assert_array_equal(out["s1"]["b"], [1.0])  # max(tau, 1)


@pytest.mark.parametrize("staleness,match", [
    ([2, 4], r"staleness has no entry for parameter \['s0'\]\['w'\]"),
    (np.array([2, 4]), r"staleness of shape \(2,\) at itself is ambiguous"),
    ({"s0": 2}, r"staleness has no entry for parameter \['s1'\]"),
    ({"s0": 2, "s1": 4, "s9": 1}, r"staleness entry \['s9'\] matches no"),
    ({"s0": jnp.ones(2), "s1": 1}, r"shape \(2,\) at \['s0'\] is ambiguous"),
])
def test_ambiguous_staleness_is_a_one_line_error(staleness, match):
  opt = sp.optim.scale_by_staleness(staleness)
  with pytest.raises(ValueError, match=match) as err:
    opt.update(_stages(), opt.init(_stages()))
  assert "\n" not in str(err.value)


def _torch_nadam(grad, x0, steps, lr, b1, b2=0.999, eps=1e-8, psi=0.004,
                 weight_decay=0.0, clip=None):
  """The official AsyncPP step in NumPy: torch.optim.NAdam (decoupled weight
  decay, as optim/nadamw.py sets it) after the stage's clip_grad_norm_
  (optim/optimizer.py lines 196-199); `grad(x, t)` gives the gradient."""
  x = np.asarray(x0, np.float64)
  m, v, mu_prod, xs = np.zeros_like(x), np.zeros_like(x), 1.0, []
  for t in range(1, steps + 1):
    g = np.asarray(grad(x, t - 1), np.float64)
    if clip is not None:  # torch.nn.utils.clip_grad_norm_
      g = g * min(clip / (np.linalg.norm(g) + 1e-6), 1.0)
    x = x * (1 - lr * weight_decay)
    mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    mu_prod *= mu
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v / (1 - b2**t)) + eps
    x = x - lr * (1 - mu) / (1 - mu_prod) * g / denom
    x = x - lr * mu_next / (1 - mu_prod * mu_next) * m / denom
    xs.append(x)
  return np.stack(xs)


def _run_nesterov(opt, grad, x0, steps):
  x = jnp.asarray(x0, jnp.float32)
  state, xs = opt.init(x), []
  for t in range(steps):
    u, state = jax.jit(opt.update)(grad(x, t), state, x)
    x = optax.apply_updates(x, u)
    xs.append(np.asarray(x))
  return np.stack(xs)


@pytest.mark.parametrize("delay,num_stages,b1", [(None, None, 0.99),
                                                  (3, 4, 0.9)])
def test_async_nesterov_is_pytorch_nadam(delay, num_stages, b1):
  rng = np.random.default_rng(2)
  grads = rng.normal(size=(12, 5)).astype(np.float32)
  grad = lambda x, t: grads[t]  # pylint: disable=unnecessary-lambda-assignment
  opt = optax.chain(
      sp.optim.scale_by_async_nesterov(b1, delay=delay, num_stages=num_stages),
      optax.scale_by_learning_rate(0.01))
  b1_eff = b1 if delay is None else b1 + delay * (0.99 - b1) / num_stages
  np.testing.assert_allclose(_run_nesterov(opt, grad, np.zeros(5), 12),
                             _torch_nadam(grad, np.zeros(5), 12, 0.01, b1_eff),
                             rtol=2e-5, atol=1e-7)


def test_async_nesterov_runs_asyncpps_official_configuration():
  # run.bash: --momentum 0.99 --optimizer nadamw --clip_grad 10, lr 3e-4
  # (a constant step here); main_with_runtime.py: weight decay 0.01.
  rng = np.random.default_rng(3)
  a = rng.normal(size=(6, 5)) * 4
  y = rng.normal(size=6) * 4
  grad = lambda x, t: a.T @ (a @ x - y * (1 + 0.1 * t))  # pylint: disable=unnecessary-lambda-assignment
  x0 = rng.normal(size=5)
  opt = optax.chain(optax.clip_by_global_norm(10.0),
                    sp.optim.scale_by_async_nesterov(),
                    optax.add_decayed_weights(0.01),
                    optax.scale_by_learning_rate(3e-4))
  want = _torch_nadam(grad, x0, 10, 3e-4, 0.99, weight_decay=0.01, clip=10.0)
  assert np.linalg.norm(grad(x0, 0)) > 10  # the clipping acts
  np.testing.assert_allclose(
      _run_nesterov(opt, lambda x, t: jnp.asarray(grad(np.asarray(x, np.float64),
                                                       t), jnp.float32),
                    x0, 10), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"delay": 1}, {"delay": -1, "num_stages": 2},
                                    {"b1": 1.0}])
def test_async_nesterov_rejects_bad_input(kwargs):
  with pytest.raises(ValueError, match="is invalid; valid:"):
    sp.optim.scale_by_async_nesterov(**kwargs)
