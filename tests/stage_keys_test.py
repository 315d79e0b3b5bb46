"""Stages that take a PRNG key (dropout) and a train flag."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from stalepipe.pipeline import stage as stage_lib

SEED = 7


def _dropout_stage(params, x, *, key, train):
  h = jnp.tanh(x @ params["w"])
  if train:
    keep = jax.random.bernoulli(key, 0.6, h.shape)
    h = jnp.where(keep, h / 0.6, 0.0)
  return h


def _head(params, x):
  return x @ params["w"]


def _params(S, seed=0):
  rng = np.random.default_rng(seed)
  return tuple({"w": rng.normal(size=(8, 8 if s < S - 1 else 4)).astype(
      np.float32) * 0.5} for s in range(S))


def _windows(num, B, M, n, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))


def _unpipelined_sgd(params, windows, lr, D, seed=SEED):
  """SGD on the composed model, each replica's slice of a micro-batch with
  the keys `stage.key_data` gives it."""
  S = len(params)

  def loss(ps, x, y, p, m, d):
    for s in range(S - 1):
      key = jax.random.wrap_key_data(stage_lib.key_data(seed, p, m, s, d))
      x = _dropout_stage(ps[s], x, key=key, train=True)
    return cross_entropy(_head(ps[-1], x), y)

  p = 0
  for x, y in windows:
    for i in range(x.shape[0]):
      n = x.shape[2] // D
      grads = [jax.grad(loss)(params, x[i, m, d * n:(d + 1) * n],
                              y[i, m, d * n:(d + 1) * n], p, m, d)
               for m in range(x.shape[1]) for d in range(D)]
      mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
      params = jax.tree.map(lambda w, g: w - lr * g, params, mean)
      p += 1
  return params


def _run(name, remat, D=1, S=3, windows=3):
  fns = [_dropout_stage] * (S - 1) + [_head]
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=2,
                               num_minibatches=2)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = executor.Pipeline(fns, cross_entropy, schedule, optax.sgd(0.3), mesh,
                           remat=remat, seed=SEED)
  ref = reference.Pipeline(fns, cross_entropy, schedule, optax.sgd(0.3),
                           num_replicas=D, seed=SEED)
  state, rstate = pipe.init(_params(S)), ref.init(_params(S))
  data = list(_windows(windows, 2, 2, 2 * D))
  for x, y in data:
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  return pipe.params(state), ref.params(rstate), data


@pytest.mark.parametrize("name,remat", [
    pytest.param("gpipe", "recompute", marks=pytest.mark.slow),
    pytest.param("1f1b", "residuals", marks=pytest.mark.slow),
    ("zb-h1", "residuals"),
    pytest.param("pipedream", "recompute", marks=pytest.mark.slow)])
def test_dropout_executor_equals_oracle(name, remat):
  got, want, _ = _run(name, remat)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_dropout_on_a_flush_schedule_equals_unpipelined_training():
  got, _, data = _run("1f1b", "recompute", D=2)
  want = _unpipelined_sgd(_params(3), data, 0.3, D=2)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
  # The keys matter: another seed's masks train to other weights.
  other = _unpipelined_sgd(_params(3), data, 0.3, D=2, seed=SEED + 1)
  assert max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(got), jax.tree.leaves(other))) > 1e-3


def test_keys_differ_per_minibatch_microbatch_stage_and_replica():
  keys = {tuple(np.asarray(stage_lib.key_data(SEED, *idx)))
          for idx in [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0),
                      (0, 0, 0, 1)]}
  assert len(keys) == 5


def test_wants_reads_the_signature():
  assert stage_lib.wants(_dropout_stage) == {"key", "train"}
  assert stage_lib.wants(_head) == frozenset()
  bound = stage_lib.bind(lambda p, x, *, train: x * (2 if train else 3),
                         train=False, first=True)
  assert bound(None, 1)[0] == 3


@pytest.mark.slow
def test_resume_with_dropout_is_bit_exact():
  """A run saved to the host after one window and restored into a fresh
  pipeline continues bit for bit: the keys come from (seed, minibatch,
  micro-batch, stage, replica), the minibatch from the state's window count."""
  S = 3
  fns = [_dropout_stage] * (S - 1) + [_head]
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=2,
                               num_minibatches=2)
  mesh = jax.make_mesh((1, S), ("data", "stage"))
  make = lambda: executor.Pipeline(fns, cross_entropy, schedule,  # pylint: disable=unnecessary-lambda-assignment
                                   optax.sgd(0.3), mesh, seed=SEED)
  data = list(_windows(3, 2, 2, 2))
  straight = make()
  state = straight.init(_params(S))
  for x, y in data:
    state, _ = straight.step(state, x, y)
  first = make()
  saved = first.init(_params(S))
  saved, _ = first.step(saved, *data[0])
  host = jax.device_get(saved)
  shardings = jax.tree.map(lambda v: v.sharding, saved)
  resumed = make()
  resumed.init(_params(S))
  restored = jax.tree.map(jax.device_put, host, shardings)
  for x, y in data[1:]:
    restored, _ = resumed.step(restored, x, y)
  for a, b in zip(jax.tree.leaves(resumed.params(restored)),
                  jax.tree.leaves(straight.params(state))):
    np.testing.assert_array_equal(a, b)
