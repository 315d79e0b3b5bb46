"""The shard_map executor against the sequential oracle, for every schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from stalepipe.models.losses import cross_entropy as classification_loss  # pylint: disable=g-import-not-at-top

# float32 sums in a different order; a few updates of lr 0.5 keep errors ~1e-7.
ATOL, RTOL = 2e-6, 1e-5
_OPTIONS = {"hetpipe": {"concurrent_minibatches": 2}}
# Device-level schedules take their own sizes and placements:
# tests/device_schedules_executor_test.py.
STAGE_LEVEL = tuple(n for n in sp.schedules.names()
                    if n not in sp.schedules.DEVICE_LEVEL)


def _make(name, S, M, B):
  return sp.schedules.make(name, num_stages=S, num_microbatches=M,
                           num_minibatches=B, **_OPTIONS.get(name, {}))


def _windows(num, B, M, n, d, classes, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    yield (rng.normal(size=(B, M, n, d)).astype(np.float32),
           rng.integers(0, classes, size=(B, M, n)).astype(np.int32))


def _assert_trees_close(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, w, atol=ATOL, rtol=RTOL)


def _run_both(schedule, staged, optimizer, num_replicas, num_windows=3,
              features=8, classes=4):
  mesh = jax.make_mesh((num_replicas, schedule.num_stages), ("data", "stage"))
  ex = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                         optimizer, mesh)
  ref = reference.Pipeline(staged.stage_fns, classification_loss, schedule,
                           optimizer, num_replicas=num_replicas)
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  B, M = schedule.num_minibatches, schedule.num_microbatches
  for x, y in _windows(num_windows, B, M, 2 * num_replicas, features, classes):
    es, em = ex.step(es, x, y)
    rs, rm = ref.step(rs, x, y)
    assert int(em["num_losses"]) == rm["num_losses"]
    if rm["num_losses"]:
      np.testing.assert_allclose(em["loss"], rm["loss"], rtol=RTOL)
    for replica in range(num_replicas):
      _assert_trees_close(ex.params(es, replica), ref.params(rs))
  return ex, es, ref, rs


@pytest.mark.parametrize("name", STAGE_LEVEL)
@pytest.mark.parametrize("S", [2, 4])
def test_executor_equals_reference(name, S):
  M = S if name in ("2bw", "zb-async") else 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  ex, _, ref, rs = _run_both(_make(name, S, M, 2), staged, optax.sgd(0.5),
                             num_replicas=2 if S == 2 else 1)
  assert rs.window == 3
  assert max(len(v) for v in rs.versions.values()) > 2  # updates really happened


@pytest.mark.parametrize("name", [
    "pipedream", pytest.param("timeprest", marks=pytest.mark.slow)])
def test_executor_equals_reference_with_adam_and_uneven_stages(name):
  # Stages of 1, 2 and 1 blocks of different widths.
  blocks = sp.models.mlp(8, 6, 3, 4, seed=7)
  staged = sp.models.split(blocks, (0, 1, 3))
  _run_both(_make(name, 3, 2, 1), staged, optax.adam(0.05), num_replicas=2,
            num_windows=4)


def test_executor_passes_stale_params_to_delay_compensation():
  """DC's `stale_params` must be the weights the gradient was computed on."""
  optimizer = optax.chain(
      sp.optim.delay_compensation(2.0, form="diagonal"), optax.sgd(0.5))
  staged = sp.models.split(sp.models.mlp(8, 6, 2, 4, seed=3), 3)
  _, es, ref, rs = _run_both(_make("pipedream", 3, 2, 2), staged, optimizer,
                             num_replicas=2)
  # Compensation changes the result, so the extra argument is really used.
  plain_ref = reference.Pipeline(staged.stage_fns, classification_loss,
                                 _make("pipedream", 3, 2, 2), optax.sgd(0.5))
  ps = plain_ref.init(staged.stage_params)
  for x, y in _windows(3, 2, 2, 4, 8, 4):
    ps, _ = plain_ref.step(ps, x, y)
  diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(ref.params(rs)), jax.tree.leaves(plain_ref.params(ps))))
  assert diff > 1e-4


@pytest.mark.parametrize("name,remat", [
    ("gpipe", "recompute"), ("1f1b", "recompute"), ("zb-h1", "recompute"),
    ("zb-h1", "residuals"), ("zb-h2", "recompute"), ("zb-h2", "residuals")])
def test_synchronous_schedules_equal_unpipelined_training(name, remat):
  S, B = 3, 2
  M = 2 * S - 1 if name == "zb-h2" else S if name == "zb-h1" else 2
  staged = sp.models.split(sp.models.mlp(8, 6, 2, 4, seed=5), S)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  pipe = executor.Pipeline(staged.stage_fns, classification_loss,
                           _make(name, S, M, B), optax.adam(0.05), mesh,
                           remat=remat)
  state = pipe.init(staged.stage_params)
  model = sp.models.unpipelined(staged)
  params, opt = staged.stage_params, optax.adam(0.05)
  opt_state = opt.init(params)
  history = [params]  # unpipelined training after 0, 1, 2, ... updates
  for x, y in _windows(2, B, M, 4, 8, 4, seed=1):
    state, _ = pipe.step(state, x, y)
    for p in range(B):
      grads = jax.grad(lambda w: jnp.mean(jnp.stack(
          [classification_loss(model(w, x[p, m]), y[p, m])  # pylint: disable=cell-var-from-loop
           for m in range(M)])))(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      history.append(params)
  # Without a flush (zb-h2) a stage may not have applied the last minibatch's
  # update when the window ends: each stage equals unpipelined training after
  # as many updates as it applied.
  applied = pipe.updates_applied(state)[0]
  assert applied.min() >= 2 * B - 1
  for s, got in enumerate(pipe.params(state)):
    _assert_trees_close(got, history[applied[s]][s])


def test_stash_ring_is_as_deep_as_the_schedule_needs():
  for name in STAGE_LEVEL:
    schedule = _make(name, 4, 4, 2)
    program = sp.pipeline.program.compile_program(schedule)
    stream = schedule.with_minibatches(12)
    assert program.num_versions == max(stream.stash_depth), name
    # A slot also holds an input that arrived before its forward starts.
    held = max(stream.max_in_flight)
    assert held <= program.num_slots <= held + 1, name


_KEEPS = ["gpipe", "1f1b", "pipedream", "2bw", "hetpipe", "zb-h1", "zb-h2",
          "zb-async"]


@pytest.mark.parametrize("name", _KEEPS)
def test_residuals_equal_recompute_and_the_oracle(name):
  """remat='residuals' (the forward's pullback kept) computes what the
  oracle computes by recomputing, for every schedule that can keep them."""
  S = 3
  M = S if name in ("2bw", "zb-async") else 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=9), S)
  schedule = _make(name, S, M, 2)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  ex = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                         optax.sgd(0.5), mesh, remat="residuals")
  ref = reference.Pipeline(staged.stage_fns, classification_loss, schedule,
                           optax.sgd(0.5), num_replicas=2)
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in _windows(3, 2, M, 4, 8, 4):
    es, em = ex.step(es, x, y)
    rs, rm = ref.step(rs, x, y)
    if rm["num_losses"]:
      np.testing.assert_allclose(em["loss"], rm["loss"], rtol=RTOL)
  _assert_trees_close(ex.params(es), ref.params(rs))
  assert es.buffers[0].residuals  # something was kept
  # Split backwards (BI, BW) keep the weight ops' output cotangents for BW.
  split = any(sp.schedules.kinds.kind(t.kind).splits_backward
              for t in schedule.tasks)
  assert bool(es.buffers[0].op_cotangents) == split == name.startswith("zb")
  ctx = ex._stages(*[ex.place(a) for a in (x, y)])  # pylint: disable=protected-access
  for layout, kept in ((ctx.residuals, es.buffers[0].residuals),
                       (ctx.split, es.buffers[0].op_cotangents)):
    rows = 2 * S * (ex.program.num_slots + 1)  # replicas, stages, slots
    assert (layout.bytes_per_slot * rows if layout else 0) == sum(
        v.nbytes for v in kept.values())


@pytest.mark.parametrize("name", ["zb-h1", pytest.param(
    "zb-async", marks=pytest.mark.slow)])
def test_split_backward_with_token_ids_equals_the_oracle(name):
  """Stage 0 takes integer token ids (an embedding lookup: no input
  cotangent) and casts its weight; the split backward matches the oracle."""
  S, M, vocab, T = 2, 2, 11, 3

  def embed(p, ids):
    h = p["embed"][ids].reshape(ids.shape[0], -1)
    return jnp.tanh(h @ p["w"].astype(jnp.bfloat16).astype(jnp.float32))

  def head(p, h):
    return h @ p["w"] + p["b"]

  rng = np.random.default_rng(4)
  params = [{"embed": rng.normal(size=(vocab, 4)).astype(np.float32),
             "w": rng.normal(size=(4 * T, 6)).astype(np.float32) / 4},
            {"w": rng.normal(size=(6, 4)).astype(np.float32),
             "b": np.zeros(4, np.float32)}]
  schedule = _make(name, S, M if name == "zb-h1" else S, 2)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  ex = executor.Pipeline([embed, head], classification_loss, schedule,
                         optax.sgd(0.5), mesh, remat="residuals")
  ref = reference.Pipeline([embed, head], classification_loss, schedule,
                           optax.sgd(0.5), num_replicas=2)
  es, rs = ex.init(params), ref.init(params)
  M = schedule.num_microbatches
  for _ in range(2):
    x = rng.integers(0, vocab, size=(2, M, 4, T)).astype(np.int32)
    y = rng.integers(0, 4, size=(2, M, 4)).astype(np.int32)
    es, _ = ex.step(es, x, y)
    rs, _ = ref.step(rs, x, y)
  _assert_trees_close(ex.params(es), ref.params(rs))
  assert es.buffers[0].op_cotangents


def test_residuals_are_refused_where_the_backward_reads_other_weights():
  staged = sp.models.split(sp.models.mlp(8, 6, 2, 4), 3)
  mesh = jax.make_mesh((1, 3), ("data", "stage"))
  with pytest.raises(ValueError, match="runs B of minibatch .* on newer weights"):
    executor.Pipeline(staged.stage_fns, classification_loss,
                      _make("timeprest", 3, 2, 2), optax.sgd(0.1), mesh,
                      remat="residuals")
  with pytest.raises(ValueError, match="remat='keep' is invalid"):
    executor.Pipeline(staged.stage_fns, classification_loss,
                      _make("gpipe", 3, 2, 2), optax.sgd(0.1), mesh,
                      remat="keep")
  with pytest.raises(ValueError, match="optimizer predicts"):
    executor.Pipeline(staged.stage_fns, classification_loss,
                      _make("gpipe", 3, 2, 2),
                      sp.optim.SpecTrain(optax.sgd(0.1),
                                         staleness="minibatch"), mesh,
                      remat="residuals")


@pytest.mark.parametrize("lowering", sorted(sp.pipeline.dispatch.LOWERINGS))
def test_every_tick_lowering_equals_the_oracle(lowering):
  """How a tick dispatches (`dispatch.py`) changes nothing computed."""
  S, M = 2, 2
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=11), S)
  schedule = _make("zb-h1", S, M, 2)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  ex = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                         optax.sgd(0.5), mesh, lowering=lowering,
                         remat="residuals")
  ref = reference.Pipeline(staged.stage_fns, classification_loss, schedule,
                           optax.sgd(0.5), num_replicas=2)
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  for x, y in _windows(2, 2, M, 4, 8, 4):
    es, _ = ex.step(es, x, y)
    rs, _ = ref.step(rs, x, y)
  _assert_trees_close(ex.params(es), ref.params(rs))
  with pytest.raises(ValueError, match="lowering 'vmap' is invalid"):
    executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                      optax.sgd(0.5), mesh, lowering="vmap")


@pytest.mark.parametrize("name,remat", [
    ("zb-h1", "residuals"),
    pytest.param("1f1b", "recompute", marks=pytest.mark.slow),
    pytest.param("pipedream", "recompute", marks=pytest.mark.slow)])
def test_stacked_layout_equals_packed_and_the_oracle(name, remat):
  """layout='stacked' (each weight leaf `[..., *shape]`, for stages of one
  structure) trains bit for bit as the packed layout does, and as the
  oracle."""
  S, M = 2, 2
  staged = sp.models.split(sp.models.mlp(6, 6, 2 * S - 1, 6, seed=4), S)
  schedule = _make(name, S, M, 2)
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  opt = optax.sgd(0.3, momentum=0.9)
  pipes = [executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                             opt, mesh, remat=remat, layout=layout)
           for layout in ("packed", "stacked")]
  states = [p.init(staged.stage_params) for p in pipes]
  assert sorted(states[1].ring[0].params) == ["0000", "0001", "0002", "0003"]
  ref = reference.Pipeline(staged.stage_fns, classification_loss, schedule,
                           opt, num_replicas=2)
  rs = ref.init(staged.stage_params)
  for x, y in _windows(2, 2, M, 4, 6, 6):
    states = [p.step(s, x, y)[0] for p, s in zip(pipes, states)]
    rs, _ = ref.step(rs, x, y)
  packed, stacked = (p.params(s) for p, s in zip(pipes, states))
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(stacked)):
    np.testing.assert_array_equal(a, b)
  _assert_trees_close(stacked, ref.params(rs))


def test_layout_is_checked_in_one_line():
  staged = sp.models.split(sp.models.mlp(8, 6, 1, 4), 2)
  mesh = jax.make_mesh((1, 2), ("data", "stage"))
  with pytest.raises(ValueError, match="layout 'flat' is invalid; valid: "
                     "packed, stacked"):
    executor.Pipeline(staged.stage_fns, classification_loss,
                      _make("1f1b", 2, 2, 1), optax.sgd(0.1), mesh,
                      layout="flat")
  pipe = executor.Pipeline(staged.stage_fns, classification_loss,
                           _make("1f1b", 2, 2, 1), optax.sgd(0.1), mesh,
                           layout="stacked")
  with pytest.raises(ValueError, match="stage 1's pytree differs"):
    pipe.init(staged.stage_params)  # stage 0 maps 8 -> 6, stage 1 6 -> 4


@pytest.mark.slow
def test_bfloat16_one_layer_stages_on_byte_windows_equal_the_oracle(
    tmp_path):
  """The depth benchmark's parts: uint8 ids from memory-mapped `stdlib`
  windows into stage 0, bfloat16 activations across the boundaries, float32
  weights, one decoder layer per stage, an asynchronous schedule."""
  S, M, B, b, L = 4, 2, 2, 2, 16
  ds = sp.data.stdlib(L, cache_dir=str(tmp_path))
  blocks = sp.models.transformer(ds.num_classes, d_model=8, num_heads=2,
                                 num_layers=S, max_len=L, fuse_ends=True,
                                 dtype="bfloat16")
  staged = sp.models.split(blocks, S)
  schedule = _make("pipedream", S, M, B)
  loss = sp.models.losses.lm_cross_entropy
  ex = executor.Pipeline(staged.stage_fns, loss, schedule, optax.sgd(0.5),
                         jax.make_mesh((1, S), ("data", "stage")))
  ref = reference.Pipeline(staged.stage_fns, loss, schedule, optax.sgd(0.5))
  es, rs = ex.init(staged.stage_params), ref.init(staged.stage_params)
  for window in range(2):
    rows = np.arange(B * M * b) + window * B * M * b
    x = ds.x_train[rows].reshape(B, M, b, L)
    y = ds.y_train[rows].reshape(B, M, b, L)
    assert x.dtype == np.uint8
    es, em = ex.step(es, x, y)
    rs, rm = ref.step(rs, x, y)
  np.testing.assert_allclose(em["loss"], rm["loss"], rtol=1e-2)
  got, want = ex.params(es), ref.params(rs)
  assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(got))
  # bfloat16 rounds where XLA's fusions put it, differently in one program
  # and in the oracle's tasks: the weights differ by a small fraction of the
  # update, where a wrong version or boundary would differ by the update.
  update = optax.tree.norm(jax.tree.map(jnp.subtract, want,
                                        staged.stage_params))
  assert optax.tree.norm(jax.tree.map(jnp.subtract, got, want)) < (
      0.05 * update)
