"""Optimizer parts named in a config: registries, schedules, weight decay, clipping, wrappers."""

import inspect

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import stalepipe as sp
from configs import default
from stalepipe.train import optimizers


def _run(opt, x, grad_fn, steps):
  state, xs = opt.init(x), []
  for _ in range(steps):
    updates, state = opt.update(grad_fn(x), state, x)
    x = optax.apply_updates(x, updates)
    xs.append(np.asarray(x))
  return np.stack(xs)


def test_registries_hold_every_public_transform_and_wrapper():
  public = {name: getattr(sp.optim, name) for name in sp.optim.__all__}
  transforms = {n for n, f in public.items() if inspect.isfunction(f) and
                isinstance(_try_build(f), optax.GradientTransformation)}
  wrappers = set(sp.optim.WRAPPERS.names())
  # Nothing public that builds a transform is left out of the registries.
  assert set(sp.optim.TRANSFORMS.names()) == transforms - wrappers
  assert {"WeightPrediction", "stale_optimizer"} <= wrappers
  assert {"warmup_cosine_decay_schedule", "piecewise_constant_schedule",
          "exponential_decay"} <= set(optimizers.SCHEDULES.names())


def _try_build(factory):
  """`factory` called with the fewest arguments that make it build, or None."""
  for args in ((), (1,), (optax.sgd(0.1), 1)):
    try:
      return factory(*args)
    except Exception:  # pylint: disable=broad-except
      continue
  return None


def test_defaults_reproduce_the_old_make_bit_for_bit():
  config = default.get_config()
  new = optimizers.from_config(config, num_replicas=2)
  old = optax.adam(1e-3)
  x = jnp.array([1.0, -2.0, 3.0])
  grad = lambda x: jnp.sin(x) + x  # pylint: disable=unnecessary-lambda-assignment
  np.testing.assert_array_equal(_run(new, x, grad, 5), _run(old, x, grad, 5))


def test_warmup_cosine_schedule_and_step_decay_follow_their_formulas():
  warm = optimizers.make_schedule((
      "warmup_cosine_decay_schedule",
      {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 10,
       "decay_steps": 110, "end_value": 0.0}))
  for t in (0, 5, 10, 60, 110):
    want = t / 10 if t <= 10 else 0.5 * (1 + np.cos(np.pi * (t - 10) / 100))
    np.testing.assert_allclose(float(warm(t)), want, atol=1e-6)
  # Step decay from a config dict (string keys, as ml_collections holds them).
  config = ml_collections.ConfigDict({"lr_schedule": (
      "piecewise_constant_schedule",
      {"init_value": 0.1, "boundaries_and_scales": {"3": 0.5}})})
  opt = optimizers.make((), "sgd", {"learning_rate": 99.0},
                        lr_schedule=config.lr_schedule)
  x = jnp.zeros(())
  xs = _run(opt, x, lambda x: jnp.ones(()), 5)
  np.testing.assert_allclose(xs, -np.cumsum([0.1, 0.1, 0.1, 0.05, 0.05]),
                             rtol=1e-6)


def test_l2_weight_decay_and_clipping_feed_the_optimizer():
  """x <- x - lr (clip(g) + wd x): SGD's weight_decay, as in DC-ASGD, SAPipe."""
  lr, wd, c = 0.1, 0.01, 1.0
  opt = optimizers.make((("stale_gradients", {"delay": 1}),), "sgd",
                        {"learning_rate": lr}, weight_decay=wd,
                        grad_clip_norm=c)
  x0 = np.array([3.0, -4.0], np.float32)
  xs = _run(opt, jnp.asarray(x0), lambda x: 2 * x, 6)
  want, x, prev = [], x0.astype(np.float64), None
  for _ in range(6):
    g = np.zeros(2) if prev is None else 2 * prev
    g = g * min(1.0, c / max(np.linalg.norm(g), 1e-30))
    prev, x = x, x - lr * (g + wd * x)
    want.append(x)
  np.testing.assert_allclose(xs, np.stack(want), rtol=1e-5)


def test_decoupled_weight_decay_is_adamw_also_with_a_schedule():
  sched = ("linear_schedule", {"init_value": 0.1, "end_value": 0.01,
                               "transition_steps": 4})
  opt = optimizers.make((), "adam", {"learning_rate": 0.1}, lr_schedule=sched,
                        weight_decay=0.1, weight_decay_mode="decoupled")
  ref = optax.adamw(optimizers.make_schedule(sched), weight_decay=0.1)
  x = jnp.array([1.0, -2.0, 0.5])
  grad = lambda x: x**3 - 1  # pylint: disable=unnecessary-lambda-assignment
  np.testing.assert_allclose(_run(opt, x, grad, 8), _run(ref, x, grad, 8),
                             rtol=1e-5, atol=1e-7)


def test_wrapper_gets_the_chain_and_num_workers_from_replicas():
  opt = optimizers.make((), "sgd", {"learning_rate": 0.1}, num_replicas=4,
                        wrapper=("WeightPrediction", {"option": 3}))
  direct = sp.optim.WeightPrediction(optax.sgd(0.1), 3, num_workers=4)
  assert isinstance(opt, sp.optim.WeightPrediction)
  x = jnp.array([1.0, -1.0])
  s1, s2 = opt.init(x), direct.init(x)
  for t in range(4):
    g, local = jnp.full(2, 0.3 * t), jnp.full(2, 0.1 * t + 0.2)
    np.testing.assert_array_equal(opt.predict(s1, x), direct.predict(s2, x))
    u1, s1 = opt.update(g, s1, x, local_updates=local)
    u2, s2 = direct.update(g, s2, x, local_updates=local)
    np.testing.assert_array_equal(u1, u2)
    x = optax.apply_updates(x, u1)


def test_stale_optimizer_wrapper_and_nesterov_transform_by_name():
  opt = optimizers.make((("scale_by_async_nesterov", {}),), "sgd",
                        {"learning_rate": 1e-2},
                        wrapper=("stale_optimizer", {"delay": 1}))
  ref = sp.optim.stale_optimizer(optax.chain(
      sp.optim.scale_by_async_nesterov(), optax.sgd(1e-2)), 1)
  x = jnp.array([0.5, 2.0])
  grad = lambda x: jnp.cos(x)  # pylint: disable=unnecessary-lambda-assignment
  np.testing.assert_array_equal(_run(opt, x, grad, 4), _run(ref, x, grad, 4))


@pytest.mark.parametrize("kwargs,match", [
    ({"lr_schedule": ("nope", {})}, "unknown schedule 'nope'; valid: "),
    ({"lr_schedule": ("cosine_decay_schedule",)}, "is invalid; valid: a"),
    ({"wrapper": ("stale_gradients", {"delay": 1})},
     "unknown optimizer wrapper 'stale_gradients'; valid: "),
    ({"weight_decay_mode": "l1", "weight_decay": 0.1},
     "weight_decay_mode='l1' is invalid; valid: "),
    ({"weight_decay": -1.0}, "weight_decay=-1.0, grad_clip_norm=0.0 is "),
])
def test_bad_optimizer_parts_are_one_line_errors(kwargs, match):
  with pytest.raises(ValueError, match=match) as err:
    optimizers.make((), "sgd", {"learning_rate": 0.1}, **kwargs)
  assert "\n" not in str(err.value)


def test_decoupled_decay_needs_a_learning_rate():
  with pytest.raises(ValueError, match="decoupled"):
    optimizers.make((), "adafactor", {}, weight_decay=0.1,
                    weight_decay_mode="decoupled")


# A gradient far above the clip, on a tree shaped like a transformer block's
# leaves (a hidden kernel, the head, a bias), so a clip after a scale-by rule
# (which normalises) would differ from one on the raw gradient.
def _block_tree(scale):
  rng = np.random.default_rng(0)
  return {"qkv": {"kernel": jnp.asarray(scale * rng.normal(size=(4, 6)),
                                        jnp.float32)},
          "linear": {"kernel": jnp.asarray(scale * rng.normal(size=(4, 5)),
                                           jnp.float32)},
          "bias": jnp.asarray(scale * rng.normal(size=(6,)), jnp.float32)}


def _tree_run(opt, x, steps=5):
  state, out = opt.init(x), []
  for t in range(steps):
    g = jax.tree.map(lambda p, t=t: 40.0 * jnp.sin(p + t) + p, x)
    updates, state = opt.update(g, state, x)
    x = optax.apply_updates(x, updates)
    out.append(x)
  return out


@pytest.mark.parametrize("rule", [
    "nesterov", pytest.param("basis_rotation", marks=pytest.mark.slow),
    "adamw"])
def test_a_config_chain_equals_its_sources_hand_built_chain(rule):
  """clip_grad_norm_ on the raw gradient, then the optimizer's step: as
  AsyncPP (`optim/optimizer.py` lines 195-199), basis-rotation
  (`optim/optimizer.py` lines 296-300) and any torch loop run them."""
  lr, wd, c = 3e-3, 0.01, 1.0
  clip = optax.clip_by_global_norm(c)
  if rule == "nesterov":
    config = ((("scale_by_async_nesterov", {"b1": 0.99}),), "sgd")
    source = optax.chain(clip, sp.optim.scale_by_async_nesterov(b1=0.99),
                         optax.sgd(lr), optimizers.decoupled_weight_decay(
                             wd, lr))
  elif rule == "basis_rotation":
    config = ((("scale_by_basis_rotation", {"mask": "attention_mlp"}),),
              "sgd")
    source = optax.chain(clip, sp.optim.basis_rotation_adam(
        lr, weight_decay=wd, mask=sp.optim.attention_mlp))
  else:
    config = ((), "adam")
    source = optax.chain(clip, optax.adamw(lr, weight_decay=wd))
  built = optimizers.make(*config, {"learning_rate": lr}, weight_decay=wd,
                          weight_decay_mode="decoupled", grad_clip_norm=c)
  x = _block_tree(1.0)
  for got, want in zip(_tree_run(built, x), _tree_run(source, x)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-7), got, want)


def test_l2_decay_joins_the_gradient_before_a_scale_by_rule():
  """SGD-style L2 decay is part of the gradient a direction rule scales."""
  lr, wd, c = 1e-2, 0.1, 1.0
  built = optimizers.make((("scale_by_async_nesterov", {}),), "sgd",
                          {"learning_rate": lr}, weight_decay=wd,
                          grad_clip_norm=c)
  source = optax.chain(optax.clip_by_global_norm(c),
                       optax.add_decayed_weights(wd),
                       sp.optim.scale_by_async_nesterov(), optax.sgd(lr))
  x = _block_tree(1.0)
  for got, want in zip(_tree_run(built, x), _tree_run(source, x)):
    jax.tree.map(np.testing.assert_array_equal, got, want)
  # Gradient-level transforms keep L2 after them (on the current weights).
  built = optimizers.make((("stale_gradients", {"delay": 1}),), "sgd",
                          {"learning_rate": lr}, weight_decay=wd)
  source = optax.chain(sp.optim.stale_gradients(1),
                       optax.add_decayed_weights(wd), optax.sgd(lr))
  for got, want in zip(_tree_run(built, x), _tree_run(source, x)):
    jax.tree.map(np.testing.assert_array_equal, got, want)
