"""Gap-Aware against a NumPy rendering of FTPipe's code (`pipe/pipeline/gap_aware/`).

The rendering follows FTPipe's order of operations step by step, in float64:
the gradient computed on the stashed weights, `update_running_avg` (SGD),
`apply_on_theta` (the penalty and its weight-decay fix-up), then the PyTorch
optimizer's step (`torch.optim.SGD`, or FTPipe's step-recording Adam
`optimizers/adam_record.py`), then the scheduler's `max_lr` update.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.train import optimizers

_A = np.random.default_rng(0).normal(size=(6, 5))
_Y = np.random.default_rng(1).normal(size=(8, 6))


def _grad(x, k):
  """Gradient of |A x - y_k|^2 / 2, a fresh target each step."""
  return _A.T @ (_A @ x - _Y[k % len(_Y)])


def _ftpipe_sgd(x, lrs, steps, delay, momentum, wd, gamma=0.999, eps=1e-8):
  """sgd_gap_aware.py `GapAware` + torch SGD, weight stashing of depth delay."""
  history, ra, buf = [x.copy()], np.zeros_like(x), np.zeros_like(x)
  max_lr = lrs[0]  # interface.py line 78: the initial lr
  for k in range(steps):
    stash = history[max(0, len(history) - 1 - delay)]
    grad = _grad(stash, k)
    # update_running_avg (lines 127-140) with the buffer before this step
    ra = gamma * ra + (1 - gamma) * (buf ** 2 if momentum else grad ** 2)
    step_count = k + 1
    c = max_lr * (np.sqrt(ra / (1 - gamma ** step_count)) + eps)
    penalty = 1 + np.abs(stash - x) / c  # apply_on_theta (lines 194-201)
    grad = grad / penalty
    grad = grad + x * wd * ((1 - penalty) / penalty)  # line 219
    d_p = grad + wd * x  # torch SGD
    buf = momentum * buf + d_p if momentum else d_p
    x = x - lrs[k] * buf
    history.append(x.copy())
    max_lr = max(max_lr, lrs[k + 1])  # the patched scheduler.step
  return x


def _ftpipe_adam(x, lrs, steps, delay, wd, b1=0.9, b2=0.999, eps=1e-8):
  """adam_gap_aware.py `AdamGapAware` + adam_record.py's Adam."""
  history = [x.copy()]
  m, v, s = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
  for k in range(steps):
    stash = history[max(0, len(history) - 1 - delay)]
    grad = _grad(stash, k)
    penalty = 1 + np.abs(stash - x) / (np.sqrt(s) + eps)  # lines 185-192
    grad = grad / penalty + x * wd * ((1 - penalty) / penalty)  # 197-214
    t = k + 1  # adam_record.py lines 107-140
    grad = grad + wd * x
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    denom = np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps
    step_size = lrs[k] / (1 - b1 ** t)
    x = x - step_size * m / denom
    s = b2 * s + (1 - b2) * step_size ** 2 * (m / denom) ** 2
    history.append(x.copy())
  return x


def _jax_run(opt, x, steps, delay):
  """The transform chain in a delay-`delay` stashed loop, in float64."""
  with jax.enable_x64(True):
    x = jnp.asarray(x, jnp.float64)
    history, state = [x], opt.init(x)
    update = jax.jit(opt.update)
    for k in range(steps):
      stash = history[max(0, len(history) - 1 - delay)]
      g = jnp.asarray(_grad(np.asarray(stash), k))
      u, state = update(g, state, x, stale_params=stash)
      x = optax.apply_updates(x, u)
      history.append(x)
    return np.asarray(x)


_LRS = [0.02, 0.02, 0.05, 0.05, 0.03, 0.03, 0.01, 0.01, 0.01]
_SCHED = optax.piecewise_constant_schedule(0.02, {2: 2.5, 4: 0.6, 6: 1 / 3})


@pytest.mark.parametrize("delay,momentum,wd", [
    (1, 0.9, 0.0), (2, 0.9, 0.05), (1, 0.0, 0.0), (2, 0.0, 0.0)])
def test_sgd_form_equals_ftpipe_over_steps(delay, momentum, wd):
  x0 = np.random.default_rng(2).normal(size=5)
  want = _ftpipe_sgd(x0, _LRS, 8, delay, momentum, wd)
  chain = [optax.add_decayed_weights(wd)] if wd else []
  opt = optax.chain(*chain, sp.optim.gap_aware(_SCHED, form="sgd",
                                               momentum=momentum),
                    optax.sgd(_SCHED, momentum=momentum or None))
  got = _jax_run(opt, x0, 8, delay)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
  plain = _jax_run(optax.chain(*chain, optax.sgd(_SCHED, momentum or None)),
                   x0, 8, delay)
  assert np.abs(got - plain).max() > 1e-3  # the penalty really acts


@pytest.mark.parametrize("delay,wd", [(1, 0.0), (2, 0.05)])
def test_adam_form_equals_ftpipe_over_steps(delay, wd):
  x0 = np.random.default_rng(3).normal(size=5)
  want = _ftpipe_adam(x0, _LRS, 8, delay, wd)
  chain = [optax.add_decayed_weights(wd)] if wd else []
  opt = optax.chain(*chain, sp.optim.gap_aware(_SCHED), optax.adam(_SCHED))
  got = _jax_run(opt, x0, 8, delay)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
  plain = _jax_run(optax.chain(*chain, optax.adam(_SCHED)), x0, 8, delay)
  assert np.abs(got - plain).max() > 1e-3


def test_config_chain_mirrors_the_optimizer_and_puts_l2_before_gap_aware():
  """From a config `gap_aware` takes the optimizer's form, learning rate
  (schedule) and moments; `weight_decay_mode="l2"` divides the decay by the
  penalty, as FTPipe."""
  x0 = np.random.default_rng(4).normal(size=5)
  sched = ("piecewise_constant_schedule", {
      "init_value": 0.02, "boundaries_and_scales": {2: 2.5, 4: 0.6, 6: 1 / 3}})
  built = optimizers.make((("gap_aware", {}),), "sgd",
                          {"learning_rate": 0.5, "momentum": 0.9},
                          lr_schedule=sched, weight_decay=0.05,
                          weight_decay_mode="l2")
  want = _ftpipe_sgd(x0, _LRS, 8, 1, 0.9, 0.05)
  np.testing.assert_allclose(_jax_run(built, x0, 8, 1), want, rtol=1e-10,
                             atol=1e-12)
  built = optimizers.make((("gap_aware", {}),), "adam",
                          {"learning_rate": 0.02, "b1": 0.8})
  want = _jax_run(optax.chain(sp.optim.gap_aware(0.02, b1=0.8),
                              optax.adam(0.02, b1=0.8)), x0, 8, 2)
  np.testing.assert_array_equal(_jax_run(built, x0, 8, 2), want)


@pytest.mark.parametrize("kwargs,optimizer,opt_kwargs,match", [
    ({"learning_rate": 0.1}, "adam", {"learning_rate": 0.02},
     "'gap_aware' learning_rate=0.1 is invalid with optimizer 'adam'; valid: "
     "its learning_rate, 0.02"),
    ({"form": "sgd"}, "adamw", {"learning_rate": 0.02},
     "form='sgd' is invalid with optimizer 'adamw'; valid: its form, 'adam'"),
    ({"b2": 0.99}, "adam", {"learning_rate": 0.02}, "b2=0.99 is invalid"),
    ({}, "adam", {"learning_rate": 0.02, "nesterov": True},
     "valid: optimizer sgd, or adam/adamw without nesterov or eps_root"),
    ({}, "lion", {"learning_rate": 0.02}, "with optimizer 'lion'"),
])
def test_config_refuses_a_gap_aware_that_does_not_mirror_its_optimizer(
    kwargs, optimizer, opt_kwargs, match):
  with pytest.raises(ValueError, match=match) as err:
    optimizers.make((("gap_aware", kwargs),), optimizer, opt_kwargs)
  assert "\n" not in str(err.value)


def test_fresh_gradient_passes_unchanged_in_float32():
  opt = sp.optim.gap_aware(0.1)
  x = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
  g = jax.tree.map(lambda p: jnp.full_like(p, 0.3), x)
  state = opt.init(x)
  for _ in range(2):
    out, state = opt.update(g, state, x, stale_params=x)
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(
        lambda a: a.dtype, g)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g)):
      np.testing.assert_array_equal(a, b)
  # From an executor (staleness given, no stale_params) a gradient is fresh.
  out, _ = opt.update(g, state, x, staleness=0)
  np.testing.assert_array_equal(out["w"], g["w"])


@pytest.mark.parametrize("kwargs,match", [
    ({"form": "adamw"}, "form='adamw' is invalid; valid: "),
    ({"b2": 1.0}, "b2=1.0 is invalid; valid: 0 <= b2 < 1"),
    ({"momentum": -0.1}, "momentum=-0.1 is invalid"),
])
def test_bad_arguments_are_one_line(kwargs, match):
  with pytest.raises(ValueError, match=match) as err:
    sp.optim.gap_aware(0.1, **kwargs)
  assert "\n" not in str(err.value)


def test_needs_params_and_stale_params():
  opt = sp.optim.gap_aware(0.1)
  x = jnp.ones(2)
  state = opt.init(x)
  with pytest.raises(ValueError, match="needs params="):
    opt.update(x, state)
  with pytest.raises(ValueError, match="stale_params=None; valid"):
    opt.update(x, state, x)
