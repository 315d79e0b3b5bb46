"""Auxiliary losses from any stage, added to the objective with gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference


def _plain(params, x):
  return jnp.tanh(x @ params["w"])


def _with_aux(params, x):
  h = jnp.tanh(x @ params["w"])
  return sp.pipeline.stage.Output(h, loss=0.3 * jnp.mean(h ** 2))


def _head(params, x):
  return x @ params["w"]


FNS = (_plain, _with_aux, _head)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return tuple({"w": rng.normal(size=(8, 8 if s < 2 else 4)).astype(
      np.float32)} for s in range(3))


def _windows(num, B, M, n, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))


def _unpipelined_sgd(params, windows, lr):
  def objective(ps, x, y):
    h1 = _plain(ps[0], x)
    h2 = jnp.tanh(h1 @ ps[1]["w"])
    return cross_entropy(_head(ps[2], h2), y) + 0.3 * jnp.mean(h2 ** 2)

  for x, y in windows:
    for i in range(x.shape[0]):
      grads = [jax.grad(objective)(params, x[i, m], y[i, m])
               for m in range(x.shape[1])]
      mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
      params = jax.tree.map(lambda w, g: w - lr * g, params, mean)
  return params


def _run(name, remat):
  schedule = sp.schedules.make(name, num_stages=3, num_microbatches=2,
                               num_minibatches=2)
  mesh = jax.make_mesh((1, 3), ("data", "stage"))
  pipe = executor.Pipeline(FNS, cross_entropy, schedule, optax.sgd(0.2), mesh,
                           remat=remat)
  ref = reference.Pipeline(FNS, cross_entropy, schedule, optax.sgd(0.2))
  state, rstate = pipe.init(_params()), ref.init(_params())
  data = list(_windows(3, 2, 2, 2))
  for x, y in data:
    state, m = pipe.step(state, x, y)
    rstate, rm = ref.step(rstate, x, y)
    if rm["num_losses"]:
      np.testing.assert_allclose(m["loss"], rm["loss"], rtol=1e-5)
  return pipe.params(state), ref.params(rstate), data


@pytest.mark.parametrize("name,remat", [
    pytest.param("1f1b", "recompute", marks=pytest.mark.slow),
    ("zb-h1", "residuals"),
    pytest.param("pipedream", "recompute", marks=pytest.mark.slow)])
def test_aux_loss_executor_equals_oracle(name, remat):
  got, want, data = _run(name, remat)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
  if name != "pipedream":  # a flush schedule: unpipelined SGD on L + a
    for a, b in zip(jax.tree.leaves(got),
                    jax.tree.leaves(_unpipelined_sgd(_params(), data, 0.2))):
      np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
