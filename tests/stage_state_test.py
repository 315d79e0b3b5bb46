"""Stage metrics and non-parameter stage state (BatchNorm statistics).

Metrics from any stage and from the loss reach `step` as their means over the
micro-batches whose loss the window took; a stage's state is updated by its
training forwards, once per micro-batch in the order the stage runs them, and
read by `evaluate`. Checked against the oracle, NumPy recursions of the same
formulas, and unpipelined NNX training of a module with a BatchNorm.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference

Output = sp.pipeline.stage.Output
EPS, MOMENTUM = 1e-5, 0.9


def _counted(params, x, *, state):
  h = jnp.tanh(x @ params["w"])
  return Output(h, metrics={"h_mean": jnp.mean(h)},
                state={"count": state["count"] + 1,
                       "mean": MOMENTUM * state["mean"]
                       + (1 - MOMENTUM) * jnp.mean(h, axis=0)})


def _batch_norm(params, x, *, state, train):
  if train:
    mu, var = jnp.mean(x, axis=0), jnp.var(x, axis=0)
    new = jax.tree.map(lambda old, b: MOMENTUM * old + (1 - MOMENTUM) * b,
                       state, {"mean": mu, "var": var})
  else:
    mu, var, new = state["mean"], state["var"], state
  y = (x - mu) / jnp.sqrt(var + EPS) * params["g"]
  return Output(jnp.tanh(y @ params["w"]), state=new)


def _head(params, x):
  return x @ params["w"]


def _loss(logits, labels):
  accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
  return cross_entropy(logits, labels), {"accuracy": accuracy}


FNS = (_counted, _batch_norm, _head)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  w = lambda *shape: rng.normal(size=shape).astype(np.float32)  # pylint: disable=unnecessary-lambda-assignment
  return ({"w": w(8, 8)}, {"g": 1 + 0.1 * w(8), "w": w(8, 8)}, {"w": w(8, 4)})


def _states():
  return ({"count": np.zeros((), np.int32), "mean": np.zeros(8, np.float32)},
          {"mean": np.zeros(8, np.float32), "var": np.ones(8, np.float32)},
          None)


def _windows(num, B, M, n, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))
          for _ in range(num)]


def _pipes(name, remat, D, lr=0.2, B=2, M=2):
  schedule = sp.schedules.make(name, num_stages=3, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((D, 3), ("data", "stage"))
  pipe = executor.Pipeline(FNS, _loss, schedule, optax.sgd(lr), mesh,
                           remat=remat)
  ref = reference.Pipeline(FNS, _loss, schedule, optax.sgd(lr),
                           num_replicas=D)
  return pipe, ref


def _close(a, b, **kw):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


@pytest.mark.parametrize("name,remat", [
    ("1f1b", "recompute"),
    pytest.param("zb-h1", "residuals", marks=pytest.mark.slow),
    pytest.param("pipedream", "recompute", marks=pytest.mark.slow)])
def test_metrics_and_state_equal_the_oracle(name, remat):
  pipe, ref = _pipes(name, remat, D=2)
  state = pipe.init(_params(), _states())
  rstate = ref.init(_params(), _states())
  for x, y in _windows(3, 2, 2, 4):
    state, m = pipe.step(state, x, y)
    rstate, rm = ref.step(rstate, x, y)
    assert int(m["num_losses"]) == rm["num_losses"]
    if rm["num_losses"]:
      for k in ("loss", "accuracy", "h_mean"):
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, atol=1e-6)
  for d in range(2):
    # BatchNorm divides by a micro-batch's deviation: float order shows more,
    # in the weights and so in the statistics the forwards of those weights
    # keep (the executor and the oracle add in different orders).
    _close(pipe.params(state, d), ref.params(rstate, d), rtol=1e-4, atol=1e-5)
    _close(pipe.stage_states(state, d), ref.stage_states(rstate, d),
           rtol=1e-4, atol=1e-5)
  assert pipe.stage_states(state)[2] is None


def test_state_and_metrics_follow_numpy_recursions():
  """GPipe, D=1, weights frozen (lr 0): stage 1's running statistics are
  the EMA of its inputs' batch statistics over the micro-batches in the
  order the stage runs them (minibatch, then micro-batch); the count is
  the number of forwards; the window's metrics are means over its
  micro-batches."""
  pipe, _ = _pipes("gpipe", "recompute", D=1, lr=0.0, B=2, M=3)
  params = _params()
  state = pipe.init(params, _states())
  mean, var = np.zeros(8), np.ones(8)
  windows = _windows(2, 2, 3, 5)
  for x, y in windows:
    state, m = pipe.step(state, x, y)
    h_means, accuracies = [], []
    for p in range(2):
      for j in range(3):
        h = np.tanh(x[p, j].astype(np.float64) @ params[0]["w"])
        h_means.append(h.mean())
        mean = MOMENTUM * mean + (1 - MOMENTUM) * h.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * h.var(0)
        z = (h - h.mean(0)) / np.sqrt(h.var(0) + EPS) * params[1]["g"]
        logits = np.tanh(z @ params[1]["w"]) @ params[2]["w"]
        accuracies.append(np.mean(logits.argmax(-1) == y[p, j]))
    np.testing.assert_allclose(m["h_mean"], np.mean(h_means), rtol=1e-5)
    np.testing.assert_allclose(m["accuracy"], np.mean(accuracies), rtol=1e-6)
  got = pipe.stage_states(state)
  assert int(got[0]["count"]) == 2 * 2 * 3
  np.testing.assert_allclose(got[1]["mean"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[1]["var"], var, rtol=1e-5, atol=1e-6)


def test_evaluate_reads_the_state_and_leaves_it():
  pipe, _ = _pipes("1f1b", "recompute", D=1)
  state = pipe.init(_params(), _states())
  for x, y in _windows(2, 2, 2, 4):
    state, _ = pipe.step(state, x, y)
  before = pipe.stage_states(state)
  x, y = _windows(1, 2, 2, 4, seed=7)[0]
  out = pipe.evaluate(state, x, y)
  _close(pipe.stage_states(state), before, rtol=0, atol=0)
  params, states = pipe.params(state), before
  h = np.tanh(x @ params[0]["w"])
  z = ((h - states[1]["mean"]) / np.sqrt(states[1]["var"] + EPS)
       * params[1]["g"])
  logits = np.tanh(z @ params[1]["w"]) @ params[2]["w"]
  np.testing.assert_allclose(out["outputs"], logits, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out["accuracy"],
                             np.mean(logits.argmax(-1) == y), rtol=1e-6)
  np.testing.assert_allclose(out["h_mean"], h.mean(), rtol=1e-5)


def test_a_training_value_that_reads_its_state_is_refused():
  def reads(params, x, *, state):
    return Output(x @ params["w"] + state["b"], state=state)

  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2)
  pipe = executor.Pipeline((reads, _head), cross_entropy, schedule,
                           optax.sgd(0.1), mesh)
  params = ({"w": np.ones((8, 8), np.float32)},
            {"w": np.ones((8, 4), np.float32)})
  state = pipe.init(params, ({"b": np.zeros(8, np.float32)}, None))
  x, y = _windows(1, 1, 2, 2)[0]
  with pytest.raises(ValueError, match="stage 0's training forward reads its "
                     "state"):
    pipe.step(state, x, y)


def test_bad_states_and_metric_names_are_refused():
  pipe, _ = _pipes("1f1b", "recompute", D=1)
  with pytest.raises(ValueError, match=r"stages \[0, 1\] take a `state`"):
    pipe.init(_params())
  with pytest.raises(ValueError, match=r"given for stages \[0, 1, 2\], but stages \[0, 1\]"):
    pipe.init(_params(), _states()[:2] + ({"x": np.zeros(1)},))

  def twice(logits, labels):
    return cross_entropy(logits, labels), {"h_mean": jnp.float32(0)}

  mesh = jax.make_mesh((1, 3), ("data", "stage"))
  schedule = sp.schedules.make("1f1b", num_stages=3, num_microbatches=2)
  x, y = _windows(1, 1, 2, 2)[0]
  for loss_fn, match in ((twice, "'h_mean' of the loss function is reported "
                          "twice"),
                         (lambda a, b: (cross_entropy(a, b), {"loss": 0.0}),
                          "'loss' of the loss function"),
                         (lambda a, b: (cross_entropy(a, b), {"step": 0.0}),
                          "'step' of the loss function .* reserved")):
    pipe = executor.Pipeline(FNS, loss_fn, schedule, optax.sgd(0.1), mesh)
    with pytest.raises(ValueError, match=match):
      pipe.step(pipe.init(_params(), _states()), x, y)


@pytest.mark.parametrize("name", sp.pipeline.stage.RESERVED)
def test_every_name_the_trainer_records_is_refused_as_a_metric(name):
  with pytest.raises(ValueError, match=f"metric '{name}' of stage 1 .* "
                     "reserved"):
    sp.pipeline.stage._merge_metrics({}, {name: 1.0}, "stage 1")  # pylint: disable=protected-access


class _Net(nnx.Module):

  def __init__(self):
    self.a = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    self.bn = nnx.BatchNorm(8, momentum=MOMENTUM, rngs=nnx.Rngs(1))
    self.b = nnx.Linear(8, 4, rngs=nnx.Rngs(2))


def _front(m, x, *, train):
  return m.bn(jnp.tanh(m.a(x)), use_running_average=not train)


def _back(m, x):
  return m.b(jnp.tanh(x))


def test_cut_carries_batch_norm_statistics_like_unpipelined_training():
  """A BatchNorm'd NNX module cut into two stages, 1F1B with SGD, equals the
  module trained unpipelined (each micro-batch's forward updating the
  statistics in order, the minibatch's gradients averaged), weights and
  statistics, and merges back."""
  B, M, n, lr = 2, 2, 4, 0.2
  staged = sp.models.cut(_Net(), [_front, _back],
                         jax.ShapeDtypeStruct((n, 8), jnp.float32))
  assert staged.stage_states[1] is None
  assert sorted(staged.stage_states[0]["bn"]) == ["mean", "var"]
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(lr), mesh)
  state = pipe.init(staged.stage_params, staged.stage_states)
  windows = _windows(2, B, M, n)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)

  model = _Net()
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def objective(params, stats, x, y):
    # Fresh Variables in this trace: NNX mutates the statistics in place.
    m = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, stats))
    loss = cross_entropy(_back(m, _front(m, x, train=True)), y)
    return loss, nnx.state(m, nnx.BatchStat)

  for x, y in windows:
    for p in range(B):
      grads = []
      for j in range(M):
        g, stats = jax.grad(objective, has_aux=True)(params, stats, x[p, j],
                                                     y[p, j])
        grads.append(g)
      mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
      params = jax.tree.map(lambda w, g: w - lr * g, params, mean)
  want = nnx.merge(graphdef, params, stats)
  got = sp.models.merge(_Net(), pipe.params(state), pipe.stage_states(state))
  _close(nnx.state(got, nnx.Param), nnx.state(want, nnx.Param), rtol=1e-5,
         atol=2e-6)
  _close(nnx.state(got, nnx.BatchStat), nnx.state(want, nnx.BatchStat),
         rtol=1e-5, atol=1e-6)
  x = windows[0][0][0, 0]
  np.testing.assert_allclose(_back(got, _front(got, x, train=False)),
                             _back(want, _front(want, x, train=False)),
                             rtol=1e-4, atol=1e-5)
