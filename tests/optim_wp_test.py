"""Tests of weight prediction (SAPipe Algorithm 3, SpecTrain) against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp

N, D, STEPS, LR, MU, LAM = 4, 5, 6, 0.05, 0.9, 0.2


def _problem():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(N, 8, D)).astype(np.float32)  # worker i: |A_i x - y|^2/2
  ys = rng.normal(size=(STEPS, N, 8)).astype(np.float32)
  return a, ys


def _np_sgd(buf, g):
  """optax.sgd(LR, MU)'s step and new trace, in float64."""
  buf = MU * buf + g
  return -LR * buf, buf


def _np_algorithm_3(option, opt=_np_sgd, opt_state=np.zeros(D),
                    warmup="zeros"):
  """SAPipe Algorithms 1 and 3 with `opt` (step, state) = opt(state, g).

  `warmup="skip"` passes at the first call (Algorithm 1 line 6); "zeros"
  feeds the empty ring's zeros through `opt`.
  """
  a, ys = _problem()
  grad = lambda i, x, t: a[i].T @ (a[i] @ x - ys[t, i])  # pylint: disable=unnecessary-lambda-assignment
  x, x_prev = np.ones(D), np.ones(D)
  applied_prev = np.zeros(D)  # G_{t-2}
  local_prev, local_prev2 = np.zeros((N, D)), np.zeros((N, D))
  pending = np.zeros(D)  # G_{t-1}, in flight
  xs = [x]
  for t in range(STEPS):
    local = np.zeros((N, D))
    for i in range(N):
      if option == 1:
        g_hat = local_prev[i]
      elif option == 2:
        g_hat = applied_prev
      else:
        others = applied_prev - local_prev2[i] / N
        dx = x - x_prev
        g_hat = others + LAM * others * (others @ dx) + local_prev[i] / N
      # Line 11: the optimizer one step ahead, its state not kept.
      x_hat = x + opt(opt_state, g_hat)[0] if t else x
      local[i] = grad(i, x_hat, t)
    applied, pending = pending, local.mean(0)
    if t == 0 and warmup == "skip":
      step = np.zeros(D)
    else:
      step, opt_state = opt(opt_state, applied)
    x_prev, x = x, x + step
    applied_prev, local_prev2, local_prev = applied, local_prev, local
    xs.append(x)
  return np.array(xs)


def _jax_run(wp):
  a, ys = _problem()

  def worker_step(params, state, a_i, y_i):
    x_hat = wp.predict(state, params)
    local = jax.grad(lambda x: 0.5 * jnp.sum((a_i @ x - y_i) ** 2))(x_hat)
    synced = jax.lax.pmean(local, "data")
    updates, state = wp.update(synced, state, params, local_updates=local)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(worker_step, axis_name="data"))
  params = jnp.ones((N, D), jnp.float32)
  state = jax.vmap(wp.init)(params)
  xs = [params[0]]
  for t in range(STEPS):
    params, state = step(params, state, a, ys[t])
    np.testing.assert_allclose(params, np.broadcast_to(params[0], params.shape),
                               rtol=1e-6)  # replicas stay in sync
    xs.append(params[0])
  return np.array(xs)


@pytest.mark.parametrize("option", [1, 2, 3])
def test_options_match_numpy_algorithm_3(option):
  wp = sp.optim.WeightPrediction(optax.sgd(LR, MU), option, num_workers=N,
                                 lam=LAM, form="full")
  np.testing.assert_allclose(_jax_run(wp), _np_algorithm_3(option), rtol=2e-4,
                             atol=1e-5)


B1, B2, EPS = 0.9, 0.999, 1e-8


def _np_adam(state, g):
  """optax.adam's step and new state (m, v, count), in float64."""
  m, v, count = state
  m, v, count = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g, count + 1
  m_hat, v_hat = m / (1 - B1 ** count), v / (1 - B2 ** count)
  return -LR * m_hat / (np.sqrt(v_hat) + EPS), (m, v, count)


@pytest.mark.parametrize("warmup", ["skip", "zeros"])
@pytest.mark.parametrize("option", [1, 2, 3])
def test_adam_options_match_numpy_algorithm_3(option, warmup):
  kwargs = {} if warmup == "skip" else {"warmup": "zeros"}  # skip: default
  wp = sp.optim.WeightPrediction(optax.adam(LR, B1, B2, EPS), option,
                                 num_workers=N, lam=LAM, form="full", **kwargs)
  want = _np_algorithm_3(option, _np_adam, (np.zeros(D), np.zeros(D), 0),
                         warmup)
  np.testing.assert_allclose(_jax_run(wp), want, rtol=2e-4, atol=1e-5)


def test_skip_makes_adams_first_real_step_lr_sign_g():
  wp = sp.optim.WeightPrediction(optax.adam(0.1), option=1)
  x = jnp.array([1.0, -2.0])
  state = wp.init(x)
  steps = []
  for g in ([4.0, -1.0], [4.0, -1.0]):
    updates, state = jax.jit(wp.update)(jnp.array(g), state, x)
    steps.append(np.asarray(updates))
  np.testing.assert_array_equal(steps[0], [0.0, 0.0])  # "Pass"
  np.testing.assert_allclose(steps[1], [-0.1, 0.1], rtol=1e-5)  # not 0.0744


def test_skip_with_fresh_leaves_and_unknown_warmup_are_refused():
  wp = sp.optim.WeightPrediction(optax.adam(0.1), option=1,
                                 mask={"a": True, "b": False})
  with pytest.raises(ValueError, match="warmup='skip' with fresh leaves"):
    wp.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
  with pytest.raises(ValueError, match="warmup='later' is invalid"):
    sp.optim.WeightPrediction(optax.adam(0.1), option=1, warmup="later")


def test_predict_runs_inner_adam_one_step_ahead_without_committing():
  adam = optax.adam(0.1)
  wp = sp.optim.WeightPrediction(adam, option=1)
  x = {"w": jnp.array([1.0, -2.0]), "h": jnp.array([0.5], jnp.bfloat16)}
  state = wp.init(x)
  g = {"w": jnp.array([0.3, 0.1]), "h": jnp.array([1.0], jnp.bfloat16)}
  _, state = wp.update(g, state, x)
  before = jax.tree.map(np.asarray, state)
  x_hat = jax.jit(wp.predict)(state, x)
  inner_step, _ = adam.update(g, state.inner_state, x)
  jax.tree.map(np.testing.assert_array_equal, x_hat,
               optax.apply_updates(x, inner_step))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state),
               before)
  assert x_hat["h"].dtype == jnp.bfloat16


def test_mask_predicts_and_delays_only_stale_leaves():
  mask = {"first": True, "last": False}
  wp = sp.optim.WeightPrediction(optax.sgd(1.0), option=1, mask=mask,
                                 warmup="zeros")
  x = {"first": jnp.zeros(2), "last": jnp.zeros(3)}
  state = wp.init(x)
  assert state.ahead["last"] == optax.MaskedNode()  # nothing kept
  g = {"first": jnp.ones(2), "last": jnp.full(3, 2.0)}
  updates, state = jax.jit(wp.update)(g, state, x)
  np.testing.assert_array_equal(updates["first"], [0.0, 0.0])  # stale
  np.testing.assert_array_equal(updates["last"], [-2.0, -2.0, -2.0])  # fresh
  x_hat = wp.predict(state, x)
  np.testing.assert_array_equal(x_hat["first"], [-1.0, -1.0])
  np.testing.assert_array_equal(x_hat["last"], x["last"])


def test_gradient_transformation_chains():
  wp = sp.optim.WeightPrediction(optax.sgd(0.1), option=2)
  opt = optax.chain(optax.clip_by_global_norm(10.0),
                    wp.gradient_transformation())
  x = jnp.ones(3)
  state, update = opt.init(x), jax.jit(opt.update)
  for _ in range(3):  # gradient x: x1 = x0 = 1, x2 = 1 - 0.1 * x0, x3 = x2 - 0.1 * x1
    updates, state = update(x, state, x, local_updates=x)
    x = optax.apply_updates(x, updates)
  np.testing.assert_allclose(x, 0.8 * np.ones(3), rtol=1e-6)


def test_spectrain_matches_formula():
  rng = np.random.default_rng(3)
  x, g, b = (rng.normal(size=(2, 3)).astype(np.float32) for _ in range(3))
  stale = {"s0": 3, "s1": 1}
  got = sp.optim.spectrain_prediction(
      {"s0": x[0], "s1": x[1]}, {"s0": g[0], "s1": g[1]},
      {"s0": b[0], "s1": b[1]}, learning_rate=0.1, staleness=stale,
      momentum=0.9)
  for i, k in enumerate(("s0", "s1")):
    want = x[i] - 0.1 * stale[k] * (0.9 * b[i] + g[i])
    np.testing.assert_allclose(got[k], want, rtol=1e-6)


def test_bad_option_raises():
  with pytest.raises(ValueError, match="option"):
    sp.optim.WeightPrediction(optax.sgd(0.1), option=4)


def _run(opt, grads, x, **extra):
  state, update = opt.init(x), jax.jit(opt.update)
  for g in grads:
    updates, state = update(g, state, x, **extra)
    x = optax.apply_updates(x, updates)
  return x


def test_works_inside_masked_multisteps_and_with_injected_inner_lr():
  grads = [{"a": jnp.full(2, float(i)), "b": jnp.full(3, 1.0 + i)}
           for i in range(1, 7)]
  x = {"a": jnp.ones(2), "b": jnp.ones(3)}
  plain = sp.optim.WeightPrediction(optax.sgd(0.1, 0.9), option=3,
                                    num_workers=2).gradient_transformation()
  want = _run(plain, grads, x)
  # The inner optimizer with an injected learning rate: the look-ahead must
  # not commit the injected state either.
  injected = sp.optim.WeightPrediction(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
      option=3, num_workers=2).gradient_transformation()
  jax.tree.map(np.testing.assert_allclose, _run(injected, grads, x), want)
  # Masked: leaf "a" alone goes through the wrapper; "b"'s gradient passes
  # through unchanged (optax.masked), and apply_updates adds it.
  masked = optax.masked(plain, {"a": True, "b": False})
  got = _run(masked, grads, x)
  a_only = _run(plain, [g["a"] for g in grads], x["a"])
  np.testing.assert_allclose(got["a"], a_only)
  np.testing.assert_allclose(got["b"], x["b"] + sum(g["b"] for g in grads))
  # MultiSteps: the wrapper sees the mean of every 2 gradients, once per 2.
  multi = optax.MultiSteps(plain, every_k_schedule=2)
  means = [jax.tree.map(lambda u, v: (u + v) / 2, grads[i], grads[i + 1])
           for i in range(0, len(grads), 2)]
  jax.tree.map(np.testing.assert_allclose, _run(multi, grads, x),
               _run(plain, means, x))
