"""The GPipe shard_map pipeline against the same model trained unpipelined."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.pipeline.executor import Pipeline
from stalepipe.models.losses import cross_entropy as classification_loss  # pylint: disable=g-import-not-at-top


def _unpipelined_sgd(staged, x, y, lr):
  """Plain SGD, one update per minibatch on the mean micro-batch loss."""
  model = sp.models.unpipelined(staged)
  params, losses = staged.stage_params, []

  def minibatch_loss(params, x_Mxbxd, y_Mxb):
    return jnp.mean(jnp.stack([classification_loss(model(params, xm), ym)
                               for xm, ym in zip(x_Mxbxd, y_Mxb)]))

  for x_p, y_p in zip(x, y):
    loss, grads = jax.value_and_grad(minibatch_loss)(params, x_p, y_p)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    losses.append(loss)
  return params, float(np.mean(losses))


def _batch(B, M, n, d, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, M, n, d)).astype(np.float32),
          rng.integers(0, 10, size=(B, M, n)).astype(np.int32))


@pytest.mark.parametrize("num_replicas,boundaries", [
    pytest.param(1, (0,), marks=pytest.mark.slow), (2, (0, 2)), (2, (0, 1, 2, 4)),
    pytest.param(1, (0, 1, 3, 4), marks=pytest.mark.slow)])
def test_gpipe_equals_unpipelined_sgd(num_replicas, boundaries):
  S, M, B, b = len(boundaries), 3, 2, 4
  blocks = sp.models.mlp(16, 12, 4, 10, seed=1)
  staged = sp.models.split(blocks, boundaries)
  mesh = jax.make_mesh((num_replicas, S), ("data", "stage"))
  schedule = sp.schedules.make("gpipe", num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  pipe = Pipeline(staged.stage_fns, classification_loss, schedule,
                  optax.sgd(0.3), mesh)
  x, y = _batch(B, M, num_replicas * b, 16)
  state, metrics = pipe.step(pipe.init(staged.stage_params), x, y)
  want, want_loss = _unpipelined_sgd(staged, x, y, 0.3)
  np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
  for replica in range(num_replicas):
    got = pipe.params(state, replica)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)


def test_gpipe_gradient_equals_unpipelined_gradient():
  """With SGD at rate 1 one update subtracts exactly the gradient."""
  S, M, b = 4, 4, 3
  staged = sp.models.split(sp.models.mlp(16, 8, 3, 10, seed=2), S)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  schedule = sp.schedules.make("gpipe", num_stages=S, num_microbatches=M)
  pipe = Pipeline(staged.stage_fns, classification_loss, schedule,
                  optax.sgd(1.0), mesh)
  x, y = _batch(1, M, 2 * b, 16, seed=3)
  state, _ = pipe.step(pipe.init(staged.stage_params), x, y)
  got = jax.tree.map(lambda p0, p1: p0 - p1, staged.stage_params,
                     pipe.params(state))
  model = sp.models.unpipelined(staged)
  want = jax.grad(lambda p: jnp.mean(jnp.stack(
      [classification_loss(model(p, x[0, m]), y[0, m]) for m in range(M)])))(
          staged.stage_params)
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6)


def test_windows_continue_where_the_last_ended():
  S, M = 2, 2
  staged = sp.models.split(sp.models.mlp(16, 8, 2, 10), S)
  mesh = jax.make_mesh((1, S), ("data", "stage"))
  one = Pipeline(staged.stage_fns, classification_loss,
                 sp.schedules.make("gpipe", num_stages=S, num_microbatches=M,
                                   num_minibatches=2), optax.adam(1e-2), mesh)
  half = Pipeline(staged.stage_fns, classification_loss,
                  sp.schedules.make("gpipe", num_stages=S, num_microbatches=M,
                                    num_minibatches=1), optax.adam(1e-2), mesh)
  x, y = _batch(2, M, 4, 16, seed=4)
  s_one, _ = one.step(one.init(staged.stage_params), x, y)
  s_half = half.init(staged.stage_params)
  for p in range(2):
    s_half, _ = half.step(s_half, x[p:p + 1], y[p:p + 1])
  for a, w in zip(jax.tree.leaves(one.params(s_one)),
                  jax.tree.leaves(half.params(s_half))):
    np.testing.assert_allclose(a, w, rtol=1e-6)


def test_bad_shapes_and_meshes_are_rejected():
  staged = sp.models.split(sp.models.mlp(16, 8, 3, 10), 4)
  schedule = sp.schedules.make("gpipe", num_stages=4, num_microbatches=2)
  with pytest.raises(ValueError, match="3 devices on 'stage' is invalid for 4 "
                     "stages; valid: a divisor of 4"):
    Pipeline(staged.stage_fns, classification_loss, schedule, optax.sgd(0.1),
             jax.make_mesh((2, 3), ("data", "stage"),
                           devices=jax.devices()[:6]))
  pipe = Pipeline(staged.stage_fns, classification_loss, schedule,
                  optax.sgd(0.1), jax.make_mesh((2, 4), ("data", "stage")))
  state = pipe.init(staged.stage_params)
  x, y = _batch(1, 2, 3, 16)
  with pytest.raises(ValueError, match="a multiple of 2 data replicas"):
    pipe.step(state, x, y)
