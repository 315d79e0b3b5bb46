"""marin's delay correctors (`delay_optim.py`: `dc_asgd_ema`, `weight_pred`) against NumPy renderings of its loop.

marin injects a constant delay tau in software (`wrap_delayed`, lines
152-262): a FIFO of tau gradients (zeros at first) and, for the DC
correctors, of the params they were computed at (seeded with the initial
params). The renderings below follow that loop step by step in float64; the
stalepipe side is the same loop built from `stale_gradients(tau)` and the
corrector.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp

_A = np.random.default_rng(0).normal(size=(7, 5))
_Y = np.random.default_rng(1).normal(size=(10, 7))
LR, TAU, STEPS = 0.03, 2, 9


def _grad(x, k):
  return _A.T @ (_A @ x - _Y[k % len(_Y)])


def _marin_dc_asgd_ema(x, lam, beta, momentum):
  """`wrap_delayed(optax.sgd(LR, momentum), tau=TAU, corrector="dc_asgd_ema")`."""
  grad_buf = [np.zeros_like(x)] * TAU  # oldest first (lines 217, 242-243)
  param_buf = [x.copy()] * TAU  # seeded with the initial params (line 221)
  v, trace = np.zeros_like(x), np.zeros_like(x)  # line 222
  for k in range(STEPS):
    g = _grad(x, k)
    g_stale, w_stale = grad_buf[0], param_buf[0]
    grad_buf, param_buf = grad_buf[1:] + [g], param_buf[1:] + [x.copy()]
    v = beta * v + (1.0 - beta) * g_stale * g_stale  # line 236
    corrected = g_stale + lam * v * (x - w_stale)  # line 237
    trace = momentum * trace + corrected  # optax.sgd's trace
    x = x - LR * trace
  return x


def _jax_loop(opt, x, predict=None):
  with jax.enable_x64(True):
    x = jnp.asarray(x, jnp.float64)
    state, update = opt.init(x), jax.jit(opt.update)
    for k in range(STEPS):
      at = x if predict is None else predict(state, x)
      g = jnp.asarray(_grad(np.asarray(at), k))
      u, state = update(g, state, x)
      x = optax.apply_updates(x, u)
    return np.asarray(x)


@pytest.mark.parametrize("lam,beta,momentum", [(1.0, 0.99, 0.0),
                                               (3.0, 0.9, 0.9)])
def test_dc_asgd_ema_equals_marins_loop(lam, beta, momentum):
  x0 = np.random.default_rng(2).normal(size=5)
  want = _marin_dc_asgd_ema(x0, lam, beta, momentum)
  sgd = optax.sgd(LR, momentum or None)
  opt = optax.chain(sp.optim.stale_gradients(TAU),
                    sp.optim.dc_asgd_ema(lam, decay=beta, delay=TAU), sgd)
  got = _jax_loop(opt, x0)
  np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)
  plain = _jax_loop(optax.chain(sp.optim.stale_gradients(TAU), sgd), x0)
  assert np.abs(got - plain).max() > 1e-4  # the correction really acts


def test_dc_asgd_ema_with_stale_params_is_marins_formula():
  rng = np.random.default_rng(3)
  lam, beta = 0.7, 0.9
  opt = sp.optim.dc_asgd_ema(lam, decay=beta)
  params = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
  state, update = opt.init(params), jax.jit(opt.update)
  v = np.zeros((3, 4))
  for _ in range(3):
    g = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
    then = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
    out, state = update(g, state, params, stale_params=then)
    gw = g["w"].astype(np.float64)
    v = beta * v + (1 - beta) * gw * gw
    want = gw + lam * v * (params["w"] - then["w"].astype(np.float64))
    np.testing.assert_allclose(out["w"], want, rtol=2e-6, atol=1e-6)
  # lam = 0: the gradient passes bit for bit.
  zero = sp.optim.dc_asgd_ema(0.0)
  out, _ = zero.update(g, zero.init(params), params, stale_params=then)
  np.testing.assert_array_equal(out["w"], g["w"])


def _marin_weight_pred(x, pred_scale, momentum):
  """`wrap_delayed(optax.sgd(LR, momentum), tau=TAU, corrector="weight_pred")`
  with the train step's gradient at w + horizon * last_update (lines 35-43,
  376-382)."""
  grad_buf = [np.zeros_like(x)] * TAU
  last_update, trace = np.zeros_like(x), np.zeros_like(x)
  for k in range(STEPS):
    g = _grad(x + TAU * pred_scale * last_update, k)
    g_stale = grad_buf[0]
    grad_buf = grad_buf[1:] + [g]
    trace = momentum * trace + g_stale
    last_update = -LR * trace  # line 260: the update applied
    x = x + last_update
  return x


@pytest.mark.parametrize("pred_scale,momentum", [(1.0, 0.9), (0.5, 0.0)])
def test_weight_pred_equals_marins_loop(pred_scale, momentum):
  x0 = np.random.default_rng(4).normal(size=5)
  want = _marin_weight_pred(x0, pred_scale, momentum)
  inner = optax.chain(sp.optim.stale_gradients(TAU),
                      optax.sgd(LR, momentum or None))
  st = sp.optim.SpecTrain(inner, staleness="minibatch",
                          horizon_scale=pred_scale)
  predict = jax.jit(lambda state, x: st.predict(state, x, ahead=TAU))
  got = _jax_loop(st, x0, predict)
  np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)
  plain = _jax_loop(inner, x0)
  assert np.abs(got - plain).max() > 1e-4


def test_horizon_scale_one_is_spectrain_bit_for_bit():
  x = jnp.array([1.0, -2.0])
  for scale in (1.0, 0.0):
    st = sp.optim.SpecTrain(optax.sgd(0.1, 0.9), staleness="minibatch",
                            horizon_scale=scale)
    base = sp.optim.SpecTrain(optax.sgd(0.1, 0.9), staleness="minibatch")
    state = st.init(x)
    _, state = st.update(jnp.array([0.3, 0.7]), state, x)
    got = st.predict(state, x, ahead=jnp.int32(3))
    if scale:
      np.testing.assert_array_equal(got, base.predict(state, x, ahead=3))
    else:
      np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize("build,match", [
    (lambda: sp.optim.dc_asgd_ema(1.0, decay=1.0),
     "decay=1.0 is invalid; valid: 0 <= decay < 1"),
    (lambda: sp.optim.delay_compensation(1.0, form="ema", adaptive="ema"),
     "form='ema' with adaptive='ema' is invalid; valid: adaptive=None"),
    (lambda: sp.optim.WeightPrediction(optax.sgd(0.1), 3, form="ema"),
     "form='ema' is invalid here; valid: 'full' or 'diagonal'"),
    (lambda: sp.optim.SpecTrain(optax.sgd(0.1), horizon_scale=-1.0),
     "horizon_scale=-1.0 is invalid; valid: a number >= 0"),
])
def test_bad_arguments_are_one_line(build, match):
  with pytest.raises(ValueError, match=match) as err:
    build()
  assert "\n" not in str(err.value)
