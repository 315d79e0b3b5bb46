"""Tests of waves, staleness-scaled rates, SDPipe's Adam and SAPipe's solver."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp


def test_wave_accumulation_sums_each_wave_and_passes_updates():
  opt = optax.chain(optax.sgd(0.5), sp.optim.wave_accumulation(3))
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(7, 4)).astype(np.float32)
  x = jnp.zeros(4)
  state, update = opt.init(x), jax.jit(opt.update)
  for t, g in enumerate(grads):
    updates, state = update(g, state)
    np.testing.assert_allclose(updates, -0.5 * g, rtol=1e-6)
    wave = state[1]
    start = t - t % 3
    np.testing.assert_allclose(wave.wave_updates,
                               -0.5 * grads[start:t + 1].sum(0), rtol=1e-5)
    assert bool(sp.optim.wave_complete(wave, 3)) == (t % 3 == 2)


def test_wave_accumulation_inside_multisteps():
  # Microbatches accumulated by MultiSteps, minibatch updates summed per wave.
  opt = optax.MultiSteps(optax.chain(optax.sgd(1.0),
                                     sp.optim.wave_accumulation(2)),
                         every_k_schedule=2)
  x = jnp.zeros(())
  state, update = opt.init(x), jax.jit(opt.update)
  for g in [1.0, 3.0, 5.0, 7.0]:  # minibatch means 2 and 6
    _, state = update(jnp.asarray(g), state)
  wave = state.inner_opt_state[1]
  assert float(wave.wave_updates) == -8.0
  assert bool(sp.optim.wave_complete(wave, 2))


def test_scale_by_staleness_fixed_per_call_and_per_leaf():
  g = {"a": jnp.full(2, 6.0), "b": jnp.full(3, 6.0, jnp.bfloat16)}
  fixed = optax.chain(optax.sgd(1.0), sp.optim.scale_by_staleness(3))
  out, _ = jax.jit(fixed.update)(g, fixed.init(g))
  np.testing.assert_array_equal(out["a"], [-2.0, -2.0])
  per_call = optax.chain(optax.sgd(1.0), sp.optim.scale_by_staleness())
  out, _ = jax.jit(per_call.update)(g, per_call.init(g),
                                    staleness={"a": 2, "b": 0})
  np.testing.assert_array_equal(out["a"], [-3.0, -3.0])
  np.testing.assert_array_equal(out["b"], np.full(3, -6.0))  # tau 0 -> 1
  assert out["b"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="staleness"):
    per_call.update(g, per_call.init(g))


def _np_variance_reduced_adam(grads, n, b1, b2, eps):
  m = v = m2 = np.zeros_like(grads[0], np.float64)
  out = []
  for t, g in enumerate(grads, start=1):
    m, v, m2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, (
        b2 * m2 + (1 - b2) * g)
    mh, vh, m2h = m / (1 - b1**t), v / (1 - b2**t), m2 / (1 - b2**t)
    v_scaled = m2h**2 + np.maximum(vh - m2h**2, 0) / n
    out.append(mh / (np.sqrt(v_scaled) + eps))
  return out


def test_variance_reduced_adam_matches_numpy_and_adam_for_one_worker():
  grads = np.random.default_rng(1).normal(1.0, 2.0, size=(8, 5)).astype(
      np.float32)
  for n in (1, 4):
    opt = sp.optim.scale_by_variance_reduced_adam(n, b1=0.9, b2=0.99)
    adam = optax.scale_by_adam(b1=0.9, b2=0.99)
    state, adam_state = opt.init(jnp.zeros(5)), adam.init(jnp.zeros(5))
    want = _np_variance_reduced_adam(grads, n, 0.9, 0.99, 1e-8)
    for g, w in zip(grads, want):
      out, state = jax.jit(opt.update)(g, state)
      np.testing.assert_allclose(out, w, rtol=2e-5)
      if n == 1:
        adam_out, adam_state = adam.update(g, adam_state)
        np.testing.assert_allclose(out, adam_out, rtol=2e-5)


def _simulated_min_k(u, b, v):
  """Brute force: a FIFO all-reduce channel simulated for every prefix k."""
  m = len(u)
  period = u.sum() + b.sum()
  if v.sum() > period:
    return None
  backward_end = [u.sum() + b[i:].sum() for i in range(m)]  # layer i (0-based)
  for k in range(m + 1):
    free, ok = 0.0, True
    for i in reversed(range(k, m)):  # fresh layers, in backward order
      free = max(free, backward_end[i]) + v[i]
      ok &= free <= period + u[:i].sum()  # next forward reaches layer i
    if ok:
      return k
  return m


def test_minimal_stale_prefix_matches_simulation():
  rng = np.random.default_rng(2)
  for _ in range(300):
    m = int(rng.integers(1, 9))
    u, b = rng.uniform(0.1, 1, m), rng.uniform(0.1, 2, m)
    v = rng.uniform(0.05, 1.5, m) * rng.choice([0.3, 1, 3])
    assert sp.optim.minimal_stale_prefix(u, b, v) == _simulated_min_k(u, b, v)


def test_minimal_stale_prefix_bad_input_raises():
  with pytest.raises(ValueError, match="shapes"):
    sp.optim.minimal_stale_prefix([1, 1], [1], [1, 1])
  with pytest.raises(ValueError, match="> 0"):
    sp.optim.minimal_stale_prefix([1], [0], [1])
