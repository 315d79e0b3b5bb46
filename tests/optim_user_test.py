"""stalepipe.optim as a Flax user writes it: nnx.Optimizer, TrainState, orbax, Explicit sharding.

Each run is checked against the same recursion in NumPy: least squares
f(W, b) = |X W + b - Y|^2 / (2n), 1-step stale gradients with SAPipe's
full-matrix delay compensation (the issue's chain), then SGD.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import stalepipe as sp

LR, LAM, STEPS = 0.1, 0.2, 6
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 16)).astype(np.float32)
Y = RNG.normal(size=(32, 8)).astype(np.float32)


def _tx():
  return optax.chain(sp.optim.stale_gradients(1),
                     sp.optim.delay_compensation(LAM, form="full"),
                     optax.sgd(LR))


def _numpy_run(w, b, steps):
  """x_{t+1} = x_t - lr DC(g_{t-1}, x_t - x_{t-1}); zeros at t = 0."""
  x = np.concatenate([w.ravel(), b]).astype(np.float64)
  prev_x, prev_g, out = None, None, []
  for _ in range(steps):
    w, b = x[:w.size].reshape(w.shape), x[w.size:]
    r = (X @ w + b - Y) / len(X)
    g = np.concatenate([(X.T @ r).ravel(), r.sum(0)])
    if prev_g is None:
      step = np.zeros_like(x)
    else:
      step = prev_g + LAM * np.dot(prev_g, x - prev_x) * prev_g
    prev_x, prev_g = x, g
    x = x - LR * step
    out.append(x)
  return np.stack(out)


def _flat(w, b):
  return np.concatenate([np.asarray(w).ravel(), np.asarray(b)])


def _loss(w, b):
  return jnp.sum((X @ w + b - Y) ** 2) / (2 * len(X))


def test_nnx_optimizer_with_orbax_restart_follows_numpy(tmp_path):
  model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  want = _numpy_run(np.asarray(model.kernel[...]), np.asarray(model.bias[...]),
                    STEPS)
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda m: _loss(m.kernel[...], m.bias[...]))(model)
    optimizer.update(model, grads)

  got = []
  for t in range(STEPS):
    if t == 3:  # save everything, rebuild from scratch, restore, go on
      ckpt = ocp.StandardCheckpointer()
      ckpt.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
      ckpt.wait_until_finished()
      model = nnx.Linear(16, 8, rngs=nnx.Rngs(1))
      optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
      abstract = nnx.state((model, optimizer))
      nnx.update((model, optimizer), ckpt.restore(tmp_path / "ckpt",
                                                   abstract))
    train_step(model, optimizer)
    got.append(_flat(model.kernel[...], model.bias[...]))
  np.testing.assert_allclose(np.stack(got), want, rtol=1e-5, atol=1e-6)


def _train_state(params, tx):
  return train_state.TrainState.create(
      apply_fn=None, params=params, tx=tx)


@jax.jit
def _ts_step(state):
  grads = jax.grad(lambda p: _loss(p["w"], p["b"]))(state.params)
  return state.apply_gradients(grads=grads)


def test_train_state_under_explicit_sharding_follows_numpy(tmp_path):
  w0 = RNG.normal(size=(16, 8)).astype(np.float32) * 0.1
  b0 = np.zeros(8, np.float32)
  want = _numpy_run(w0, b0, STEPS)
  mesh = jax.make_mesh((8,), ("d",))  # Explicit, JAX's default
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(w0, NamedSharding(mesh, P("d", None))),
              "b": jax.device_put(b0, NamedSharding(mesh, P("d")))}
    state = _train_state(params, _tx())
    got = []
    for t in range(STEPS):
      if t == 3:
        with ocp.PyTreeCheckpointer() as ckpt:
          ckpt.save(tmp_path / "ts", state)
          abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
          state = ckpt.restore(tmp_path / "ts", item=abstract)
      state = _ts_step(state)
      got.append(_flat(state.params["w"], state.params["b"]))
    # FSDP-like: the stale buffer and the params history are sharded like
    # the params, never replicated.
    stale, dc, _ = state.opt_state
    for buf in (stale.buffer, dc.history):
      for key in ("w", "b"):
        shard = buf[key].addressable_shards[0].data
        assert shard.shape == (1, *params[key].addressable_shards[0].data.shape)
  np.testing.assert_allclose(np.stack(got), want, rtol=1e-5, atol=1e-6)
