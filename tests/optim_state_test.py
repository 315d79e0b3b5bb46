"""Every stalepipe.optim state: orbax round trip, sharding like its params, Explicit/Auto/none under jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import stalepipe as sp


def _sgd():
  return optax.sgd(0.05, momentum=0.9)


def _wp(option):
  return sp.optim.WeightPrediction(_sgd(), option, num_workers=2, lam=0.2
                                   ).gradient_transformation()


# Every public transform and wrapper, each chained as a user would.
CASES = {
    "stale_gradients": lambda: optax.chain(sp.optim.stale_gradients(2),
                                           _sgd()),
    "stale_gradients_per_leaf": lambda: optax.chain(
        sp.optim.stale_gradients({"w": 1, "b": 0}), _sgd()),
    "dc_full": lambda: optax.chain(sp.optim.stale_gradients(1),
                                   sp.optim.delay_compensation(0.2,
                                                               form="full"),
                                   _sgd()),
    "dc_diagonal_ema": lambda: optax.chain(
        sp.optim.stale_gradients(1),
        sp.optim.delay_compensation(0.2, adaptive="ema"), _sgd()),
    "dc_full_current_delay0": lambda: optax.chain(
        sp.optim.delay_compensation(0.2, form="full", adaptive="current",
                                    delay=0), _sgd()),
    "wp_option1": lambda: _wp(1),
    "wp_option2": lambda: _wp(2),
    "wp_option3": lambda: _wp(3),
    "stale_optimizer": lambda: sp.optim.stale_optimizer(optax.adam(1e-2), 2),
    "scale_by_staleness": lambda: optax.chain(
        _sgd(), sp.optim.scale_by_staleness({"w": 2, "b": 3})),
    "wave_accumulation": lambda: optax.chain(_sgd(),
                                             sp.optim.wave_accumulation(2)),
    "variance_reduced_adam": lambda: optax.chain(
        sp.optim.scale_by_variance_reduced_adam(4),
        optax.scale_by_learning_rate(1e-2)),
    "async_nesterov": lambda: optax.chain(
        sp.optim.stale_gradients(1),
        sp.optim.scale_by_async_nesterov(delay=1, num_stages=4),
        optax.scale_by_learning_rate(1e-2)),
    "gap_aware_adam": lambda: optax.chain(sp.optim.gap_aware(1e-2),
                                          optax.adam(1e-2)),
    "gap_aware_sgd": lambda: optax.chain(
        sp.optim.gap_aware(0.05, form="sgd", momentum=0.9), _sgd()),
    "dc_asgd_ema": lambda: optax.chain(
        sp.optim.stale_gradients(1), sp.optim.dc_asgd_ema(0.2, delay=1),
        _sgd()),
}
N = 8  # devices, all on one mesh axis "d"


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}


def _grad(params, t):
  # A gradient that depends on the params and the step, like a real one.
  return jax.tree.map(lambda x: jnp.tanh(x) + 0.1 * t, params)


def _extra(name, params):
  if name == "dc_full_current_delay0" or name.startswith("gap_aware"):
    return {"stale_params": jax.tree.map(lambda x: 0.9 * x, params)}
  return {}


def _run(opt, name, params, state, steps, start=0):
  @jax.jit
  def step(params, state, t):
    updates, state = opt.update(_grad(params, t), state, params,
                                **_extra(name, params))
    return optax.apply_updates(params, updates), state
  for t in range(start, start + steps):
    params, state = step(params, state, jnp.float32(t))
  return params, state


def _mesh(axis_type):
  return jax.make_mesh((N,), ("d",), axis_types=(axis_type,))


def _sharded(params, mesh):
  return jax.device_put(params, NamedSharding(mesh, P("d")))


def _assert_sharded_like_params(state, params):
  """Per-device bytes of each buffer = its param's per-device bytes x depth."""
  shard_bytes = lambda x: x.addressable_shards[0].data.nbytes  # pylint: disable=unnecessary-lambda-assignment
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if leaf.ndim == 0:
      continue
    key = next(k.key for k in reversed(path)
               if isinstance(k, jax.tree_util.DictKey))
    param = params[key]
    depth = leaf.shape[0] if leaf.ndim == param.ndim + 1 else 1
    assert leaf.shape[leaf.ndim - param.ndim:] == param.shape, path
    assert shard_bytes(leaf) == shard_bytes(param) * depth, (
        jax.tree_util.keystr(path), leaf.sharding)
    checked += 1
  return checked


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_zero_size_state_leaves(name):
  state = CASES[name]().init(_params())
  assert all(leaf.size for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize("checkpointer", [
    "standard", pytest.param("pytree", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_orbax_round_trip_continues_bit_for_bit(tmp_path, name, checkpointer):
  opt = CASES[name]()
  params, state = _run(opt, name, _params(), opt.init(_params()), 3)
  path = tmp_path / "ckpt"
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, state))
  if checkpointer == "standard":
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(path, (params, state))
      ckpt.wait_until_finished()
      restored = ckpt.restore(path, abstract)
  else:
    ckpt = ocp.PyTreeCheckpointer()
    ckpt.save(path, (params, state))
    restored = ckpt.restore(path, item=abstract)
  assert jax.tree.structure(restored) == jax.tree.structure((params, state))
  straight = _run(opt, name, params, state, 4, start=3)
  resumed = _run(opt, name, *restored, 4, start=3)
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_under_explicit_auto_and_no_sharding_agree(name):
  opt = CASES[name]()
  plain = _run(opt, name, _params(), opt.init(_params()), 3)
  for axis_type in (AxisType.Explicit, AxisType.Auto):
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
      params = _sharded(_params(), mesh)
      state = opt.init(params)
      assert _assert_sharded_like_params(state, params) or name in (
          "scale_by_staleness",)
      params, state = _run(opt, name, params, state, 3)
      _assert_sharded_like_params(state, params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                   atol=1e-6), (params, state), plain)


@pytest.mark.parametrize("name", ["stale_gradients", "dc_full", "wp_option3"])
def test_init_under_jit_with_explicit_sharding_keeps_it(name):
  opt = CASES[name]()
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = _sharded(_params(), mesh)
    state = jax.jit(opt.init)(params)
  assert _assert_sharded_like_params(state, params)
