"""Tests of stalepipe.optim.delay_compensation against NumPy renderings."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from tests import executor_update_rules_test as rules


def _np_dc(g, dx, lam, form, adaptive, eps, ms=None):
  """SAPipe eq. (1) / DC-ASGD(-a) on flat float64 vectors."""
  if adaptive == "ema":
    lam = lam / np.sqrt(ms + eps)
  elif adaptive == "current":
    lam = lam / np.sqrt((g * g if form == "diagonal" else g @ g) + eps)
  if form == "diagonal":
    return g + lam * g * g * dx
  return g + lam * (np.outer(g, g) @ dx)  # the matrix the code never builds


def _tree(rng):
  return {"a": rng.normal(size=(4, 3)).astype(np.float32),
          "b": rng.normal(size=(5,)).astype(np.float32)}


def _flat(tree):
  return np.concatenate([np.asarray(tree[k], np.float64).ravel() for k in "ab"])


@pytest.mark.parametrize("form,adaptive", list(itertools.product(
    ["diagonal", "full"], [None, "ema", "current"])))
def test_matches_numpy_with_stale_params(form, adaptive):
  rng = np.random.default_rng(0)
  lam, eps, decay = 0.3, 1e-7, 0.9
  opt = sp.optim.delay_compensation(lam, form=form, adaptive=adaptive,
                                    delay=0, eps=eps, decay=decay)
  params = _tree(rng)
  state, update = opt.init(params), jax.jit(opt.update)
  ms = np.zeros(17)
  for _ in range(3):
    g, then = _tree(rng), _tree(rng)
    out, state = update(g, state, params, stale_params=then)
    ms = decay * ms + (1 - decay) * _flat(g) ** 2
    want = _np_dc(_flat(g), _flat(params) - _flat(then), lam, form, adaptive,
                  eps, ms)
    np.testing.assert_allclose(_flat(out), want, rtol=2e-5, atol=1e-6)


def _quadratic_run(opt, steps=6, mixed=False):
  """Runs opt on f(x) = |A x - y|^2 / 2 with a fresh target each step."""
  rng = np.random.default_rng(1)
  a = rng.normal(size=(6, 4)).astype(np.float32)
  ys = rng.normal(size=(steps, 6)).astype(np.float32)
  x = {"w": jnp.ones((4,), jnp.float32),
       "v": jnp.ones((2,), jnp.bfloat16 if mixed else jnp.float32)}
  state, update = opt.init(x), jax.jit(opt.update)
  xs = [x]
  for y in ys:
    g = {"w": a.T @ (a @ np.asarray(x["w"]) - y), "v": x["v"] * 0.5}
    g = jax.tree.map(lambda gi, xi: jnp.asarray(gi, xi.dtype), g, x)
    updates, state = update(g, state, x)
    x = optax.apply_updates(x, updates)
    xs.append(x)
  return xs, a, ys


@pytest.mark.parametrize("form", ["diagonal", "full"])
def test_history_path_is_sapipe_algorithm_2(form):
  lam, lr = 0.5, 0.02
  xs, a, ys = _quadratic_run(optax.chain(
      sp.optim.stale_gradients(1),
      sp.optim.delay_compensation(lam, form=form), optax.sgd(lr)))
  x, x_prev, g_prev = np.ones(6), None, None
  for t, y in enumerate(ys):
    g = np.concatenate([a.T @ (a @ x[:4] - y), x[4:] * 0.5])
    out = np.zeros(6) if t == 0 else _np_dc(g_prev, x - x_prev, lam, form,
                                            None, 0.0)
    x_prev, g_prev, x = x, g, x - lr * out
    got = np.concatenate([np.asarray(xs[t + 1][k]) for k in ("w", "v")])
    np.testing.assert_allclose(got, x, rtol=1e-5)


@pytest.mark.parametrize("form,adaptive", [("diagonal", None), ("full", None),
                                           ("diagonal", "ema"),
                                           ("full", "current")])
def test_lam_zero_is_bit_identical_to_no_compensation(form, adaptive):
  plain, _, _ = _quadratic_run(
      optax.chain(sp.optim.stale_gradients(1), optax.sgd(0.05, 0.9)),
      mixed=True)
  injected = optax.inject_hyperparams(sp.optim.delay_compensation,
                                      static_args=("delay", "form", "adaptive"))
  for dc in [sp.optim.delay_compensation(0.0, form=form, adaptive=adaptive),
             injected(lam=0.0, form=form, adaptive=adaptive)]:
    comp, _, _ = _quadratic_run(optax.chain(
        sp.optim.stale_gradients(1), dc, optax.sgd(0.05, 0.9)), mixed=True)
    for x, y in zip(plain, comp):
      for k in x:
        assert x[k].dtype == y[k].dtype
        np.testing.assert_array_equal(np.asarray(x[k]).view(np.uint8),
                                      np.asarray(y[k]).view(np.uint8))


def test_injected_lam_matches_fixed_lam():
  fixed, _, _ = _quadratic_run(optax.chain(
      sp.optim.stale_gradients(1), sp.optim.delay_compensation(0.3),
      optax.sgd(0.02)))
  injected, _, _ = _quadratic_run(optax.chain(
      sp.optim.stale_gradients(1),
      optax.inject_hyperparams(sp.optim.delay_compensation,
                               static_args=("delay",))(lam=0.3),
      optax.sgd(0.02)))
  for x, y in zip(fixed, injected):
    np.testing.assert_allclose(x["w"], y["w"], rtol=1e-6)


def test_masked_and_partition_forward_stale_params():
  rng = np.random.default_rng(2)
  params, then, g = _tree(rng), _tree(rng), _tree(rng)
  dc = sp.optim.delay_compensation(0.7, delay=0)
  masked = optax.masked(dc, {"a": True, "b": False},
                        mask_compatible_extra_args=True)
  part = optax.partition({"dc": dc, "id": optax.identity()},
                         {"a": "dc", "b": "id"}, mask_compatible_extra_args=True)
  want_a = _np_dc(np.ravel(g["a"]), np.ravel(params["a"] - then["a"]), 0.7,
                  "diagonal", None, 0.0)
  for opt in (masked, part):
    out, _ = jax.jit(opt.update)(g, opt.init(params), params, stale_params=then)
    np.testing.assert_allclose(np.ravel(out["a"]), want_a, rtol=1e-6)
    np.testing.assert_array_equal(out["b"], g["b"])


@pytest.mark.parametrize("form,adaptive", [("full", "current"),
                                           ("diagonal", "ema")])
def test_delay_0_from_an_executor_without_stale_params_is_a_fresh_gradient(
    form, adaptive):
  """The executor passes `staleness=` always and `stale_params=` only on a
  stale schedule: without them the gradient was computed on `params`, so it
  passes unchanged, with the state as if `stale_params=params`."""
  rng = np.random.default_rng(4)
  params, g = _tree(rng), _tree(rng)
  dc = sp.optim.delay_compensation(0.7, form=form, adaptive=adaptive, delay=0)
  state = dc.init(params)
  out, fresh = dc.update(g, state, params, staleness=jnp.int32(0))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g)):
    np.testing.assert_array_equal(a, b)
  _, given = dc.update(g, state, params, stale_params=params)
  for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(given)):
    np.testing.assert_array_equal(a, b)


def test_delay_0_at_one_stage_trains_as_without_compensation():
  """PipeDream on one stage has no stale gradient: the executor with
  DC(delay=0) trains as the oracle with the bare optimizer (it was refused)."""
  schedule = sp.schedules.make("pipedream", num_stages=1, num_microbatches=2,
                               num_minibatches=3)
  adam = optax.adam(1e-2)
  dc = optax.chain(sp.optim.delay_compensation(0.7, form="full",
                                               adaptive="current", delay=0),
                   adam)
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=2), 1)
  mesh = jax.make_mesh((1, 1), ("data", "stage"))
  ex = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, dc, mesh)
  state = ex.init(staged.stage_params)
  for x, y in rules._windows(3, 3, 2, 2):
    state, _ = ex.step(state, x, y)
  want = rules._plain(schedule, adam, staged, 1)
  rules._close(ex.params(state, 0), want)


def test_bad_inputs_raise():
  x = jnp.ones(3)
  with pytest.raises(ValueError, match="form"):
    sp.optim.delay_compensation(0.1, form="block")
  with pytest.raises(ValueError, match="adaptive"):
    sp.optim.delay_compensation(0.1, adaptive="rms")
  opt = sp.optim.delay_compensation(0.1)
  with pytest.raises(ValueError, match="params"):
    opt.update(x, opt.init(x))
  opt = sp.optim.delay_compensation(0.1, delay=0)
  with pytest.raises(ValueError, match="stale_params"):
    opt.update(x, opt.init(x), x)
