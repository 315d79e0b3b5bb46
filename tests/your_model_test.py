"""A researcher's own NNX model, cut by code, in every executor."""

import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stalepipe as sp
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from tests import unpipelined

EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).parent.parent
                             / "experiments" / "your_model.py"),
                         run_name="example")
S, M, B, D = 3, 2, 1, 1


def _optimizer():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.5))


def _full_dc():
  """SAPipe's full delay compensation: <g, dx> over the whole model."""
  return optax.chain(sp.optim.delay_compensation(2.0, form="full"),
                     optax.sgd(0.5))


def _train(name, optimizer, remat="recompute", evaluate=False, **kw):
  model, staged = EXAMPLE["build"](S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, EXAMPLE["loss_fn"], schedule,
                           optimizer, mesh, seed=3, remat=remat, **kw)
  ref = reference.Pipeline(staged.stage_fns, EXAMPLE["loss_fn"], schedule,
                           optimizer, num_replicas=D, seed=3, **kw)
  data = list(EXAMPLE["windows"](2, B, M, 2 * D))
  state = pipe.init(staged.stage_params, staged.stage_states)
  rstate = ref.init(staged.stage_params, staged.stage_states)
  for x, y in data:
    state, metrics = pipe.step(state, x, y)
    rstate, rmetrics = ref.step(rstate, x, y)
    if rmetrics["num_losses"]:
      for k in ("loss", "accuracy"):
        np.testing.assert_allclose(metrics[k], rmetrics[k], atol=ATOL)
  if evaluate:  # the stages' latest weights and statistics, forward only
    got, want = pipe.evaluate(state, *data[0]), ref.evaluate(rstate, *data[0])
    for k in ("loss", "accuracy"):
      _close(got[k], want[k], ATOL)
    # Weights ATOL apart can round a hidden value crossing a bf16 boundary to
    # the next bf16 step (2^-8 relative), which moves every output after it:
    # the outputs agree to a bf16 step of their largest magnitude (7.1e-3 at
    # 3.7 on an AMD EPYC, with the weights 3.7e-5 apart).
    scale = max(float(np.max(np.abs(np.asarray(w, np.float32))))
                for w in jax.tree.leaves(want["outputs"]))
    _close(got["outputs"], want["outputs"], max(ATOL, 2.0**-8 * scale))
  return model, staged, (pipe.params(state), pipe.stage_states(state)), (
      ref.params(rstate), ref.stage_states(rstate)), data


def _close(got, want, atol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=atol)


# The hidden state and its cotangent cross in bfloat16: a float sum XLA takes
# in another order (the executor's one program against the oracle's task by
# task, and which order depends on the CPU it compiles for) rounds a value one
# bf16 step (2^-8 relative) apart, and SGD at lr 0.5 carries it into the
# weights: up to 7.4e-4 in the first stage's embedding after two updates
# through two boundaries, where float32 would agree to 1e-6.
ATOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name,make_optimizer", [
    ("1f1b", _optimizer), ("zb-h1", _optimizer), ("1f1b", _full_dc)])
def test_cut_model_with_a_whole_model_rule_equals_oracle_and_unpipelined(
    name, make_optimizer):
  model, staged, got, want, data = _train(name, make_optimizer())
  _close(got, want, ATOL)
  # Unpipelined: the stages composed, keys as the pipeline derives them, the
  # auxiliary losses added, the BatchNorm statistics updated by each
  # micro-batch's forward in order.
  fns, params = staged.stage_fns, tuple(staged.stage_params)
  states = list(staged.stage_states)
  opt = make_optimizer()
  opt_state = opt.init(params)
  p = 0
  for x, y in data:
    for i in range(B):
      def loss(ps, states, m):
        h, aux, new = x[i, m], 0.0, list(states)
        for s in range(S):
          key = jax.random.wrap_key_data(
              sp.pipeline.stage.key_data(3, p, m, s, 0))  # pylint: disable=cell-var-from-loop
          kw = {} if states[s] is None else {"state": states[s]}
          out = fns[s](ps[s], h, key=key, train=True, **kw)
          if isinstance(out, sp.pipeline.stage.Output):
            h, aux = out.value, aux + out.loss
            new[s] = out.state if states[s] is not None else None
          else:
            h = out
        return EXAMPLE["loss_fn"](h, y[i, m])[0] + aux, new  # pylint: disable=cell-var-from-loop
      grads = []
      for m in range(M):
        g, states = jax.grad(loss, has_aux=True)(params, states, m)
        grads.append(g)
      mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
      updates, opt_state = opt.update(mean, opt_state, params)
      params = optax.apply_updates(params, updates)
      p += 1
  _close(got, (params, states), ATOL)
  # Merged back, the module holds the trained weights and statistics.
  sp.models.merge(model, *got)
  np.testing.assert_array_equal(model.pos[...], got[0][0]["pos"])
  np.testing.assert_array_equal(model.bn.mean[...], got[1][1]["bn"]["mean"])


def test_asynchronous_schedule_with_global_norm_is_refused():
  with pytest.raises(ValueError, match="optimizer_scope='stage'"):
    _train("pipedream", _optimizer())


@pytest.mark.slow
def test_asynchronous_schedule_equals_oracle_per_stage():
  """Weights, statistics and a forward-only `evaluate` of the trained state
  equal the oracle's."""
  _, _, got, want, _ = _train("pipedream", optax.sgd(0.5), evaluate=True)
  _close(got, want, ATOL)


def test_cut_refuses_lost_and_tied_parameters_and_uncarried_state():
  model, _ = EXAMPLE["build"](S)
  example = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  first, last = EXAMPLE["first"], EXAMPLE["last"]
  with pytest.raises(ValueError, match="read by no stage"):
    sp.models.cut(model, [first, EXAMPLE["middle"](1)], example)

  def tied_last(m, x, *, key, train):
    return last(m, x, key=key, train=train) + m.pos[0, 0]
  with pytest.raises(ValueError, match="'pos' is read by stages 0 and 2"):
    sp.models.cut(model, [first, EXAMPLE["middle"](1), tied_last], example)

  class Cached(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.c = nnx.Cache(jnp.zeros(4))
  with pytest.raises(ValueError, match="Cache 'c' is state the pipelines do "
                     "not carry"):
    sp.models.cut(Cached(), [lambda m, x: m.lin(x)],
                  jax.ShapeDtypeStruct((2, 4), jnp.float32))

  class Normed(nnx.Module):
    def __init__(self):
      self.bn = nnx.BatchNorm(4, use_bias=False, use_scale=False,
                              rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="statistic 'bn.mean' is read by stages "
                     "0 and 1"):
    sp.models.cut(Normed(), [lambda m, x: m.bn(x), lambda m, x: m.bn(x)],
                  jax.ShapeDtypeStruct((2, 4), jnp.float32))


@pytest.mark.slow
def test_resume_with_dropout_and_statistics_is_bit_exact():
  """The LM (dropout, a BatchNorm'd stage, auxiliary losses) on PipeDream,
  saved to the host after one window and restored into a fresh pipeline,
  continues bit for bit: weights and statistics."""
  _, staged = EXAMPLE["build"](S)
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=M,
                               num_minibatches=2)
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  make = lambda: executor.Pipeline(  # pylint: disable=unnecessary-lambda-assignment
      staged.stage_fns, EXAMPLE["loss_fn"], schedule, optax.sgd(0.5), mesh,
      seed=3)
  data = list(EXAMPLE["windows"](3, 2, M, 2 * D))
  straight = make()
  state = straight.init(staged.stage_params, staged.stage_states)
  for x, y in data:
    state, _ = straight.step(state, x, y)
  first = make()
  saved, _ = first.step(first.init(staged.stage_params, staged.stage_states),
                        *data[0])
  host, shardings = jax.device_get(saved), jax.tree.map(lambda v: v.sharding,
                                                        saved)
  resumed = make()
  resumed.init(staged.stage_params, staged.stage_states)
  restored = jax.tree.map(jax.device_put, host, shardings)
  for x, y in data[1:]:
    restored, _ = resumed.step(restored, x, y)
  for a, b in zip(jax.tree.leaves((resumed.params(restored),
                                   resumed.stage_states(restored))),
                  jax.tree.leaves((straight.params(state),
                                   straight.stage_states(state))),
                  strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(
    set(sp.schedules.names()) - set(sp.schedules.DEVICE_LEVEL)
    - {"1f1b", "zb-h1", "pipedream"}))
def test_every_schedule_runs_the_lm_as_the_oracle(name):
  """The LM with everything a stage can do (dropout, a dict boundary with
  int ids beside bf16, a BatchNorm'd stage, auxiliary losses, a metric) on
  every other schedule, per-stage SGD (remat='residuals' where the backward
  splits): weights, statistics, loss and accuracy equal the oracle's. (Not
  Adam: the attention's key bias has a zero gradient up to rounding, which
  Adam's normalisation would blow up to a full step of either sign.)"""
  remat = "residuals" if name.startswith("zb") else "recompute"
  _, _, got, want, _ = _train(name, optax.sgd(0.5), remat=remat,
                              optimizer_scope="stage")
  _close(got, want, ATOL)


# The optimizer sees the module's own tree. A small decoder-ish module (an
# embedding, RMSNorm scales, a head) cut into two stages, trained by 1F1B and
# by the user's unpipelined optax loop on the module's nested parameter dict
# (`nnx.to_pure_dict`, the paths `nnx.Optimizer` hands optax): masks and
# labels that select leaves by path must mean the same leaves in both.
class _Tiny(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.norm = nnx.RMSNorm(8, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)
    self.out_norm = nnx.RMSNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 16, rngs=rngs)


def _tiny_front(m, ids):
  return m.mlp(m.norm(m.embed(ids)))


def _tiny_back(m, h):
  return m.head(m.out_norm(jax.nn.silu(h)))


def _tiny_loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         targets).mean()


def _by_path(fn):
  """A mask or label function of the parameters, from `fn(keys, leaf)`."""
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, v: fn(tuple(getattr(k, "key", getattr(k, "idx", k))
                               for k in path), v), params)


_FROZEN_EMBED = _by_path(lambda keys, _: "frozen" if keys[0] == "embed"
                         else "train")
_NOT_SCALES = _by_path(lambda keys, _: keys[-1] != "scale")
_KERNELS = _by_path(lambda keys, _: keys[-1] == "kernel")
_NNX_FILTER = nnx.filterlib.to_predicate(
    nnx.Any(nnx.PathContains("embed"), nnx.PathContains("out_norm")))


def _freeze(labels):
  return optax.multi_transform({"train": optax.adam(0.05),
                                "frozen": optax.set_to_zero()}, labels)


_TREE_OPTIMIZERS = {
    "multi_transform": lambda: _freeze(_FROZEN_EMBED),
    "adamw_mask_global_norm": lambda: optax.chain(  # optimizer_scope "model"
        optax.clip_by_global_norm(0.5),
        optax.adamw(0.05, weight_decay=0.5, mask=_NOT_SCALES)),
    "adamw_mask": lambda: optax.adamw(0.05, weight_decay=0.5,
                                      mask=_NOT_SCALES),
    "masked": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.5), _KERNELS),
        optax.sgd(0.1)),
    "nnx_filter": lambda: _freeze(_by_path(
        lambda keys, v: "frozen" if _NNX_FILTER(keys, v) else "train")),
}


def _tiny_windows(B=1, M=2, n=2, L=4):
  rng = np.random.default_rng(0)
  for _ in range(2):
    ids = rng.integers(0, 16, size=(B, M, n, L + 1)).astype(np.int32)
    yield ids[..., :-1], ids[..., 1:]


def _unpipelined_tiny(optimizer, windows):
  """The user's own loop: optax on the module's nested parameter dict."""
  graphdef, state = nnx.split(_Tiny(nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)

  def loss(params, x, y):
    s = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(s, params)
    m = nnx.merge(graphdef, s)
    return _tiny_loss(_tiny_back(m, _tiny_front(m, x)), y)

  return unpipelined.train(loss, params, optimizer, windows)


def _pipelined_tiny(optimizer, windows, schedule="1f1b", **kw):
  staged = sp.models.cut(_Tiny(nnx.Rngs(0)), [_tiny_front, _tiny_back],
                         jax.ShapeDtypeStruct((2, 4), jnp.int32))
  schedule = sp.schedules.make(schedule, num_stages=2, num_microbatches=2,
                               num_minibatches=1)
  pipe = executor.Pipeline(staged.stage_fns, _tiny_loss, schedule, optimizer,
                           jax.make_mesh((1, 2), ("data", "stage")), **kw)
  state = pipe.init(staged.stage_params)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)
  model = sp.models.merge(_Tiny(nnx.Rngs(0)), pipe.params(state))
  return pipe, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("name", [
    "multi_transform",
    pytest.param("adamw_mask_global_norm", marks=pytest.mark.slow),
    pytest.param("adamw_mask", marks=pytest.mark.slow),
    pytest.param("masked", marks=pytest.mark.slow),
    pytest.param("nnx_filter", marks=pytest.mark.slow)])
def test_path_masks_and_labels_mean_what_they_mean_unpipelined(name):
  windows = list(_tiny_windows())
  pipe, got = _pipelined_tiny(_TREE_OPTIMIZERS[name](), windows)
  assert pipe.optimizer_scope == ("model" if "global_norm" in name
                                  else "stage")
  want = _unpipelined_tiny(_TREE_OPTIMIZERS[name](), windows)
  _close(got, want, 1e-5)
  initial = nnx.to_pure_dict(nnx.state(_Tiny(nnx.Rngs(0)), nnx.Param))
  if name in ("multi_transform", "nnx_filter"):  # frozen: bit for bit
    np.testing.assert_array_equal(got["embed"]["embedding"],
                                  initial["embed"]["embedding"])


def test_a_label_tree_of_the_whole_module_fits_the_model_scope_only():
  """Labels given as a tree (not a function) fit the tree they were made
  for: with optimizer_scope="model" the rule steps on the module's whole
  tree and equals the unpipelined loop; per stage it is refused in one
  line."""
  initial = nnx.to_pure_dict(nnx.state(_Tiny(nnx.Rngs(0)), nnx.Param))
  labels = _FROZEN_EMBED(initial)
  windows = list(_tiny_windows())
  with pytest.raises(ValueError, match="fails on stage 0's parameters.*"
                     "functions of the parameters"):
    _pipelined_tiny(_freeze(labels), windows, optimizer_scope="stage")
  _, got = _pipelined_tiny(_freeze(labels), windows, optimizer_scope="model")
  _close(got, _unpipelined_tiny(_freeze(labels), windows), 1e-5)


@pytest.mark.slow
def test_a_flush_schedule_takes_a_new_sequence_length_between_steps():
  """1F1B at L = 4, then L = 8: recompiled for the new shapes, equal to the
  unpipelined loop; an asynchronous schedule, whose earlier windows' work
  is in flight, refuses it in one line naming the shape it was built for."""
  windows = [next(_tiny_windows(L=4)), next(_tiny_windows(L=8))]
  _, got = _pipelined_tiny(optax.sgd(0.5), windows)
  _close(got, _unpipelined_tiny(optax.sgd(0.5), windows), 1e-5)
  with pytest.raises(ValueError, match=r"inputs shape \(1, 2, 2, 8\) is not "
                     r"the shape \(1, 2, 2, 4\) this run was built for"):
    _pipelined_tiny(optax.sgd(0.5), windows, schedule="pipedream")


def test_a_loss_that_is_not_a_scalar_is_refused_in_one_line():
  staged = sp.models.cut(_Tiny(nnx.Rngs(0)), [_tiny_front, _tiny_back],
                         jax.ShapeDtypeStruct((2, 4), jnp.int32))
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
                               num_minibatches=1)
  per_token = optax.softmax_cross_entropy_with_integer_labels  # no .mean()
  x, y = next(_tiny_windows())
  pipe = executor.Pipeline(staged.stage_fns, per_token, schedule,
                           optax.sgd(0.1), jax.make_mesh((1, 2),
                                                         ("data", "stage")))
  ref = reference.Pipeline(staged.stage_fns, per_token, schedule,
                           optax.sgd(0.1))
  match = r"loss function returned shape \(2, 4\); valid: a scalar"
  for run in (lambda: pipe.step(pipe.init(staged.stage_params), x, y),
              lambda: pipe.evaluate(pipe.init(staged.stage_params), x, y),
              lambda: ref.step(ref.init(staged.stage_params), x, y)):
    with pytest.raises(ValueError, match=match):
      run()


def test_evaluate_keeps_each_output_dtype_and_equals_the_oracles():
  """A bool leaf of the last stage's output comes back bool from
  `evaluate` (not the int32 of a sum over 'stage'); the oracle's
  `evaluate` gives the same loss and outputs (two replicas)."""
  def front(m, ids):
    return {"h": _tiny_front(m, ids), "keep": ids > 3}

  def back(m, x):
    return _tiny_back(m, x["h"]), x["keep"]

  staged = sp.models.cut(_Tiny(nnx.Rngs(0)), [front, back],
                         jax.ShapeDtypeStruct((2, 4), jnp.int32))
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
                               num_minibatches=1)
  loss = lambda y, t: _tiny_loss(y[0], t)  # pylint: disable=unnecessary-lambda-assignment
  pipe = executor.Pipeline(staged.stage_fns, loss, schedule, optax.sgd(0.1),
                           jax.make_mesh((2, 2), ("data", "stage")))
  ref = reference.Pipeline(staged.stage_fns, loss, schedule, optax.sgd(0.1),
                           num_replicas=2)
  x, y = next(_tiny_windows(n=4))
  got = pipe.evaluate(pipe.init(staged.stage_params), x, y)
  want = ref.evaluate(ref.init(staged.stage_params), x, y)
  logits, keep = got["outputs"]
  assert keep.dtype == jnp.bool_ and logits.dtype == jnp.float32
  np.testing.assert_array_equal(keep, x > 3)
  np.testing.assert_array_equal(want["outputs"][1], x > 3)
  np.testing.assert_allclose(logits, want["outputs"][0], atol=1e-6)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


class _Dropped(nnx.Module):
  """A module with NNX's own dropout, its RNG stream stored in the module."""

  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.b = nnx.Linear(8, 4, rngs=rngs)


def _dropped_front(m, x, *, train):
  return m.drop(jnp.tanh(m.a(x)), deterministic=not train)


def _cut_dropped():
  model = _Dropped(nnx.Rngs(0, dropout=1))
  return model, sp.models.cut(model, [_dropped_front, lambda m, h: m.b(h)],
                              jax.ShapeDtypeStruct((2, 8), jnp.float32))


def test_nnx_dropout_draws_from_the_stage_key():
  """`nnx.Dropout(rate, rngs=rngs)` called as written: the cut stage takes a
  key and the module's RNG stream draws from it, so its masks follow the
  documented per-(minibatch, micro-batch, stage, replica) key."""
  model, staged = _cut_dropped()
  front = staged.stage_fns[0]
  assert sp.pipeline.stage.wants(front) == {"key", "train"}
  x = jnp.ones((4, 8))
  run = lambda seed, train=True: front(  # pylint: disable=unnecessary-lambda-assignment
      staged.stage_params[0], x, key=jax.random.key(seed), train=train)
  np.testing.assert_array_equal(run(1), run(1))
  assert np.any((run(1) == 0) != (run(2) == 0))  # another key, other masks
  assert 0 < np.mean(run(1) == 0) < 1
  np.testing.assert_array_equal(run(1, train=False), jnp.tanh(model.a(x)))


@pytest.mark.slow
def test_nnx_dropout_in_the_executor_equals_the_oracle():
  """The cut module with NNX's dropout on PipeDream over two replicas: the
  executor equals the oracle (the same key per task)."""
  _, staged = _cut_dropped()
  S, M, B, D = 2, 2, 2, 2
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=M,
                               num_minibatches=B)
  pipe = executor.Pipeline(staged.stage_fns, sp.models.losses.cross_entropy,
                           schedule, optax.sgd(0.5),
                           jax.make_mesh((D, S), ("data", "stage")), seed=5)
  ref = reference.Pipeline(staged.stage_fns, sp.models.losses.cross_entropy,
                           schedule, optax.sgd(0.5), num_replicas=D, seed=5)
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  rng = np.random.default_rng(0)
  for _ in range(2):
    x = rng.normal(size=(B, M, 2 * D, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=(B, M, 2 * D)).astype(np.int32)
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  _close(pipe.params(state), ref.params(rstate), 2e-6)
  before = jax.tree.leaves(staged.stage_params)
  assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(
      jax.tree.leaves(pipe.params(state)), before))


def test_a_python_int_across_a_boundary_is_named_when_it_fails_there():
  """A Python int returned beside the hidden state and used as a slice
  bound by the next stage arrives traced; `cut` names the leaf and says
  that constants belong in the stage function."""
  def front(m, ids):
    return {"h": _tiny_front(m, ids), "length": 3}

  def back(m, x):
    return _tiny_back(m, x["h"][:, :x["length"]])

  with pytest.raises(ValueError, match=r"stage 0 passes Python scalars at "
                     r"\['length'\] to stage 1, where they arrive "
                     "traced.*constants .* in the stage function"):
    sp.models.cut(_Tiny(nnx.Rngs(0)), [front, back],
                  jax.ShapeDtypeStruct((2, 4), jnp.int32))


def test_merge_keeps_the_modules_sharding():
  """A module whose kernel `nnx.with_partitioning` shards over a 'model'
  axis gets the pipeline's weights back in that sharding."""
  class Sharded(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 8, rngs=rngs, kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), (None, "model")))
      self.b = nnx.Linear(8, 4, rngs=rngs)

  with jax.set_mesh(jax.make_mesh((1, 4), ("data", "model"))):
    model = Sharded(nnx.Rngs(0))
  sharding = model.a.kernel[...].sharding
  assert sharding.spec == jax.sharding.PartitionSpec(None, "model")
  staged = sp.models.cut(model, [lambda m, x: m.a(x), lambda m, x: m.b(x)],
                         jax.ShapeDtypeStruct((2, 8), jnp.float32))
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2)
  pipe = executor.Pipeline(staged.stage_fns, sp.models.losses.cross_entropy,
                           schedule, optax.sgd(0.1),
                           jax.make_mesh((1, 2), ("data", "stage")))
  trained = jax.tree.map(lambda v: v * 2,
                         pipe.params(pipe.init(staged.stage_params)))
  sp.models.merge(model, trained)
  assert model.a.kernel[...].sharding == sharding
  np.testing.assert_array_equal(model.a.kernel[...],
                                trained[0]["a"]["kernel"])


class _TiedLM(nnx.Module):
  """The head is the embedding's transpose (`attend`), as in GPT-2."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)
    self.norm = nnx.RMSNorm(8, rngs=rngs)


def _tied_front(m, ids):
  return m.mlp(m.embed(ids))


def _tied_back(m, h):
  return m.embed.attend(m.norm(jax.nn.silu(h)))


@pytest.mark.slow
def test_a_head_tied_to_the_embedding_trains_as_one_parameter():
  """cut(..., tied=) gives the first and last stage each a copy of the
  embedding; the pipeline sums their gradients and applies one update on
  both (Megatron's embedding group), so 1F1B with Adam equals the
  unpipelined loop on the tied module, the copies stay bit-identical, and
  the oracle agrees. Per stage, or on a schedule that cannot update every
  stage at once, it is refused in one line."""
  example = jax.ShapeDtypeStruct((2, 4), jnp.int32)
  with pytest.raises(ValueError, match="'embed.embedding' is read by stages 0 "
                     "and 1; valid: .*tied="):
    sp.models.cut(_TiedLM(nnx.Rngs(0)), [_tied_front, _tied_back], example)
  staged = sp.models.cut(_TiedLM(nnx.Rngs(0)), [_tied_front, _tied_back],
                         example, tied=("embed.embedding",))
  assert all("embed" in p for p in staged.stage_params)
  schedule = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
                               num_minibatches=1)
  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  for scope, name in (("stage", "1f1b"), ("auto", "pipedream")):
    with pytest.raises(ValueError, match=r"\['embed.embedding'\] are tied"):
      executor.Pipeline(staged.stage_fns, _tiny_loss, sp.schedules.make(
          name, num_stages=2, num_microbatches=2), optax.adam(0.05), mesh,
                        optimizer_scope=scope, tied=staged.tied)
  pipe = executor.Pipeline(staged.stage_fns, _tiny_loss, schedule,
                           optax.adam(0.05), mesh, tied=staged.tied)
  ref = reference.Pipeline(staged.stage_fns, _tiny_loss, schedule,
                           optax.adam(0.05), tied=staged.tied)
  assert pipe.optimizer_scope == "model"
  windows = list(_tiny_windows())
  state, rstate = pipe.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)
    rstate, _ = ref.step(rstate, x, y)
  got = pipe.params(state)
  np.testing.assert_array_equal(got[0]["embed"]["embedding"],
                                got[1]["embed"]["embedding"])
  _close(got, ref.params(rstate), 1e-6)

  graphdef, params = nnx.split(_TiedLM(nnx.Rngs(0)))

  def loss(pure, x, y):
    s = jax.tree.map(lambda v: v, params)
    nnx.replace_by_pure_dict(s, pure)
    m = nnx.merge(graphdef, s)
    return _tiny_loss(_tied_back(m, _tied_front(m, x)), y)

  want = unpipelined.train(loss, nnx.to_pure_dict(params), optax.adam(0.05),
                           windows)
  merged = sp.models.merge(_TiedLM(nnx.Rngs(0)), got)
  _close(nnx.to_pure_dict(nnx.state(merged, nnx.Param)), want, 1e-5)
