"""Tests of stalepipe.optim.stale_gradients against NumPy and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp


def _params():
  return {"w": jnp.zeros((3, 2), jnp.float32), "b": jnp.zeros((2,), jnp.bfloat16)}


def _grads(rng, steps):
  return [{"w": rng.normal(size=(3, 2)).astype(np.float32),
           "b": jnp.asarray(rng.normal(size=(2,)), jnp.bfloat16)}
          for _ in range(steps)]


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_emits_gradient_of_delay_calls_ago_with_zero_warmup(delay):
  opt = sp.optim.stale_gradients(delay)
  state = opt.init(_params())
  update = jax.jit(opt.update)
  grads = _grads(np.random.default_rng(delay), 7)
  for t, g in enumerate(grads):
    out, state = update(g, state)
    want = grads[t - delay] if t >= delay else jax.tree.map(np.zeros_like, g)
    for k in g:
      assert out[k].dtype == jnp.asarray(g[k]).dtype
      np.testing.assert_array_equal(np.asarray(out[k], np.float32),
                                    np.asarray(want[k], np.float32))
  want_buffer = {"w": jnp.float32, "b": jnp.bfloat16} if delay else {
      "w": optax.MaskedNode(), "b": optax.MaskedNode()}  # no buffer at all
  assert jax.tree.map(lambda x: x.dtype, state.buffer) == want_buffer


def _root_radius(c, d):
  # x_{t+1} = x_t - c x_{t-d}: characteristic polynomial z^{d+1} - z^d + c.
  return np.abs(np.roots([1.0, -1.0] + [0.0] * (d - 1) + [c])).max() if d else (
      abs(1 - c))


@pytest.mark.parametrize("delay", [0, 1, 2, 4])
def test_quadratic_stability_threshold(delay):
  threshold = 2 * np.sin(np.pi / (2 * (2 * delay + 1)))
  # The closed form agrees with the characteristic polynomial's roots.
  assert _root_radius(0.99 * threshold, delay) < 1 < _root_radius(
      1.01 * threshold, delay)
  a, steps = 2.0, 1500
  for factor, stable in [(0.9, True), (1.1, False)]:
    lr = factor * threshold / a
    opt = optax.chain(sp.optim.stale_gradients(delay), optax.sgd(lr))

    def step(carry, _, opt=opt):
      x, state = carry
      updates, state = opt.update(a * x, state)
      return (optax.apply_updates(x, updates), state), x

    x0 = jnp.asarray(1.0, jnp.float32)
    _, xs = jax.lax.scan(jax.jit(step), (x0, opt.init(x0)), None, length=steps)
    want = [1.0] * (delay + 1)  # warm-up: zero updates
    for t in range(delay, steps - 1):
      want.append(want[t] - lr * a * want[t - delay])
    np.testing.assert_allclose(np.asarray(xs[:60]), want[:60], rtol=1e-4,
                               atol=1e-6)
    assert (abs(float(xs[-1])) < 1e-3) == stable, (factor, float(xs[-1]))


def test_partial_staleness_per_leaf_masked_and_partition_agree():
  params = _params()
  grads = _grads(np.random.default_rng(0), 4)
  mask = {"w": True, "b": False}
  variants = {
      "per_leaf": sp.optim.stale_gradients({"w": 1, "b": 0}),
      "masked": optax.masked(sp.optim.stale_gradients(1), mask),
      "partition": optax.partition(
          {"stale": sp.optim.stale_gradients(1), "fresh": optax.identity()},
          {"w": "stale", "b": "fresh"}),
  }
  for name, opt in variants.items():
    state, update = opt.init(params), jax.jit(opt.update)
    stale_bytes = sum(x.nbytes for x in jax.tree.leaves(state)
                      if x.ndim > 1 or x.size > 1)
    assert stale_bytes == 3 * 2 * 4, name  # only "w" is buffered
    for t, g in enumerate(grads):
      out, state = update(g, state)
      want_w = grads[t - 1]["w"] if t else np.zeros((3, 2))
      np.testing.assert_array_equal(out["w"], want_w)
      np.testing.assert_array_equal(out["b"], g["b"])


def test_inside_multisteps_delays_the_accumulated_gradients():
  opt = optax.MultiSteps(optax.chain(sp.optim.stale_gradients(1),
                                     optax.sgd(1.0)), every_k_schedule=2)
  x = jnp.zeros(())
  state = opt.init(x)
  update = jax.jit(opt.update)
  outs = []
  for g in [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]:
    updates, state = update(jnp.asarray(g), state, x)
    outs.append(-float(updates))
  # Means 2, 6, 10 emitted every second call, each one emission late.
  assert outs == [0.0, 0.0, 0.0, 2.0, 0.0, 6.0]


@pytest.mark.parametrize("delay", [-1, 1.5, True])
def test_bad_delay_raises(delay):
  with pytest.raises(ValueError, match="delay"):
    sp.optim.stale_gradients(delay)
