"""Folding: an S-stage schedule on P < S devices trains the S-device weights.

Every placement (consecutive, loop, V), every schedule, sync policy and
update rule: the folded executor equals the sequential oracle, and where both
fit, the S-device executor bit for bit.
"""

import re

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import placement as placement_lib
from stalepipe.pipeline import reference

ATOL, RTOL = 3e-6, 2e-5
_OPTIONS = {"hetpipe": {"concurrent_minibatches": 2},
            "no-stash": {"weight_stashing": False}}


def _schedule(name, S=4, M=2, B=2):
  base = "pipedream" if name == "no-stash" else name
  M = S if base in ("2bw", "zb-async", "zb-h1") else M
  return sp.schedules.make(base, num_stages=S, num_microbatches=M,
                           num_minibatches=B, **_OPTIONS.get(name, {}))


def _windows(num, schedule, D, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  B, M = schedule.num_minibatches, schedule.num_microbatches
  for _ in range(num):
    yield (rng.normal(size=(B, M, 2 * D, 8)).astype(dtype),
           rng.integers(0, 4, size=(B, M, 2 * D)).astype(np.int32))


def _mesh(D, P, axis_type=None):
  kwargs = {} if axis_type is None else {"axis_types": (axis_type,) * 2}
  return jax.make_mesh((D, P), ("data", "stage"),
                       devices=jax.devices()[:D * P], **kwargs)


def _train(pipe, staged, schedule, D, dtype=np.float32, num_windows=3):
  state = pipe.init(staged.stage_params)
  losses = []
  for x, y in _windows(num_windows, schedule, D, dtype=dtype):
    state, metrics = pipe.step(state, x, y)
    losses.append(float(metrics["loss"]))
  return [pipe.params(state, r) for r in range(D)], losses, state


def _oracle(staged, schedule, optimizer, D, sync=None, num_windows=3):
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, num_replicas=D, sync=sync)
  state = ref.init(staged.stage_params)
  losses = []
  for x, y in _windows(num_windows, schedule, D):
    state, metrics = ref.step(state, x, y)
    losses.append(float(metrics["loss"]))
  return [ref.params(state, r) for r in range(D)], losses


def _close(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, w, atol=ATOL, rtol=RTOL)


def _check(name, P, placement="consecutive", D=1, optimizer=None, sync=None,
           S=4, M=2, remat="recompute", unfolded=False, **kwargs):
  """The folded run against the oracle (and the S-device executor)."""
  schedule = _schedule(name, S, M)
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  optimizer = optimizer or optax.sgd(0.5)
  pipe = executor.Pipeline(
      staged.stage_fns, cross_entropy, schedule, optimizer, _mesh(D, P),
      sync=sync() if sync else None, remat=remat, placement=placement,
      **kwargs)
  got, losses, state = _train(pipe, staged, schedule, D)
  # Each slot's ring holds the most versions any of its stages keeps.
  depth = schedule.with_minibatches(6 * schedule.num_minibatches).stash_depth
  assert [r.versions.shape[-1] for r in state.ring] == [
      max(depth[s] for s in slot) for slot in pipe.placement.stages.T]
  want, want_losses = _oracle(staged, schedule, optimizer, D,
                              sync() if sync else None)
  np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
  for g, w in zip(got, want):
    _close(g, w)
  if unfolded:
    full = executor.Pipeline(
        staged.stage_fns, cross_entropy, schedule, optimizer, _mesh(D, S),
        sync=sync() if sync else None, remat=remat, **kwargs)
    same, _, _ = _train(full, staged, schedule, D)
    for g, e in zip(got, same):
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
        np.testing.assert_array_equal(a, b)


def _quick_or_slow(cases, quick):
  """`pytest.param`s of `cases` (tuples), those not in `quick` marked slow
  (marks must be there at collection for `-m "not slow"` to see them)."""
  return [pytest.param(*c, marks=() if c in quick else pytest.mark.slow)
          for c in cases]


_QUICK = {("1f1b", 2)}
# Also run on S devices and compared bit for bit.
_BITWISE = _QUICK | {("pipedream", 1), ("zb-h1", 1)}


@pytest.mark.parametrize("name,P", _quick_or_slow(
    [(n, P) for n in sp.schedules.names() if n not in sp.schedules.DEVICE_LEVEL
     for P in (1, 2)], _QUICK))
def test_every_schedule_folded_equals_the_oracle(name, P):
  _check(name, P, unfolded=(name, P) in _BITWISE)


@pytest.mark.parametrize("placement,name,P,remat", [
    ("loop", "1f1b", 2, "recompute"),
    pytest.param("v", "zb-h1", 2, "residuals", marks=pytest.mark.slow),
    pytest.param("loop", "pipedream", 2, "residuals", marks=pytest.mark.slow),
    pytest.param("v", "no-stash", 2, "recompute", marks=pytest.mark.slow),
    pytest.param("v", "pipedream", 1, "recompute", marks=pytest.mark.slow),
    pytest.param("loop", "zb-h2", 2, "residuals", marks=pytest.mark.slow)])
def test_loop_and_v_placements_equal_the_oracle(placement, name, P, remat):
  _check(name, P, placement, remat=remat)


@pytest.mark.slow
def test_a_zig_zag_of_four_legs_equals_the_oracle():
  """S = 8 on 2 devices under "v": device 0 holds stages 0, 3, 4, 7."""
  assert placement_lib.make("v", 8, 2).stages.tolist() == [[0, 3, 4, 7],
                                                           [1, 2, 5, 6]]
  _check("pipedream", 2, "v", S=8)


_POLICIES = {
    "wsp": ("hetpipe", lambda: sp.sync.wsp(2, clock_distance=1,
                                           concurrent_minibatches=2)),
    "sdpipe": ("1f1b", lambda: sp.sync.sdpipe(
        2, history=3, window=0.1,
        ready_times=np.tile([[[0.0, 1.0]] * 4], (12, 1, 1)))),
    "ad_psgd": ("pipedream", lambda: sp.sync.ad_psgd(2, seed=3)),
    "local_sgd": ("timeprest", lambda: sp.sync.local_sgd(2, period=3)),
    "bsp": ("zb-async", lambda: sp.sync.bsp(2)),
}


@pytest.mark.parametrize("policy", _quick_or_slow(
    [(p,) for p in _POLICIES], {("ad_psgd",)}))
def test_sync_policies_folded_onto_one_device_equal_the_oracle(policy):
  name, make = _POLICIES[policy]
  _check(name, 1, D=2, sync=make)


_RULES = {
    "spectrain": ("no-stash", lambda: sp.optim.SpecTrain(optax.sgd(0.3, 0.9))),
    "spectrain_minibatch": ("no-stash", lambda: sp.optim.SpecTrain(
        optax.sgd(0.3, 0.9), staleness="minibatch")),
    "pipemare": ("no-stash", lambda: sp.optim.PipeMare(
        optax.sgd(0.3), warmup_steps=4, decay=0.5)),
    "wp3": ("gpipe", lambda: sp.optim.WeightPrediction(
        optax.sgd(0.3, 0.9), option=3, num_workers=1, lam=0.2)),
    "dc": ("pipedream", lambda: optax.chain(
        sp.optim.delay_compensation(2.0, form="diagonal"), optax.sgd(0.5))),
    "clip": ("1f1b", lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                         optax.adam(0.05))),
    "nesterov": ("pipedream", lambda: optax.chain(
        sp.optim.scale_by_async_nesterov(), optax.scale(-0.05))),
}


@pytest.mark.parametrize("rule,P", _quick_or_slow(
    [(r, P) for r in _RULES for P in (1, 2)],
    {("spectrain", 1)}))
def test_update_rules_folded_equal_the_oracle(rule, P):
  name, make = _RULES[rule]
  # SpecTrain's own staleness is defined for one micro-batch a minibatch.
  _check(name, P, optimizer=make(), M=1 if rule == "spectrain" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("P,placement", [(1, "consecutive"), (2, "v")])
def test_basis_rotation_folded_equals_the_s_device_executor(P, placement):
  """Basis rotation turns rounding into steps where a gradient is rank-
  deficient (docs/optim.md: O(1) between two programs on this MLP, even in
  float64, where `eigh` picks the null space's basis), so it is held to the
  S-device executor, in float64: the same up to rounding's 1e-13."""
  S = 4
  schedule = _schedule("pipedream", S)
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  runs = []
  with jax.enable_x64(True):
    staged = staged._replace(stage_params=jax.tree.map(
        lambda p: np.asarray(p, np.float64), staged.stage_params))
    for devices, where in ((S, "consecutive"), (P, placement)):
      pipe = executor.Pipeline(
          staged.stage_fns, cross_entropy, schedule,
          sp.optim.basis_rotation_adam(0.01, precondition_frequency=2),
          _mesh(1, devices), placement=where)
      runs.append(_train(pipe, staged, schedule, 1, np.float64)[0][0])
  for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]),
                  strict=True):
    np.testing.assert_allclose(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.slow
def test_evaluate_folded_equals_evaluate_on_s_devices():
  schedule = _schedule("1f1b")
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4, seed=4), 4)
  x, y = next(_windows(1, schedule, 2, seed=5))
  out = []
  for P, placement in ((4, "consecutive"), (1, "consecutive"), (2, "v")):
    pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                             optax.sgd(0.5), _mesh(2, P), placement=placement)
    state = pipe.init(staged.stage_params)
    state, _ = pipe.step(state, x, y)
    out.append(pipe.evaluate(state, x, y))
  for got in out[1:]:
    np.testing.assert_array_equal(got["outputs"], out[0]["outputs"])
    np.testing.assert_array_equal(got["loss"], out[0]["loss"])


def test_folded_under_auto_axes_equals_the_oracle():
  schedule = _schedule("pipedream")
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4, seed=4), 4)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.5),
                           _mesh(1, 2, jax.sharding.AxisType.Auto))
  got, _, _ = _train(pipe, staged, schedule, 1)
  want, _ = _oracle(staged, schedule, optax.sgd(0.5), 1)
  _close(got[0], want[0])


def test_pipedream_keeps_s_minus_one_versions_a_stage_folded_on_one_device():
  # PipeDream with one micro-batch: stage s of S keeps S - s versions, so
  # one device holds S + (S-1) + ... + 1 of them, not S x S.
  S = 4
  schedule = sp.schedules.make("pipedream", num_stages=S, num_microbatches=1,
                               num_minibatches=2)
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.5), _mesh(1, 1))
  state = pipe.init(staged.stage_params)
  assert [r.versions.shape[-1] for r in state.ring] == [S - s
                                                        for s in range(S)]


@pytest.mark.parametrize("name,S,P", [("consecutive", 8, 4), ("loop", 8, 2),
                                      ("v", 8, 4), ("v", 12, 4), ("v", 6, 1),
                                      ("consecutive", 6, 1)])
def test_every_stage_sends_to_its_neighbours_exactly_once(name, S, P):
  placement = placement_lib.make(name, S, P)
  assert sorted(placement.stages.ravel().tolist()) == list(range(S))
  assert all(placement.stages[placement.where(s)] == s for s in range(S))
  for step in (1, -1):
    received = {}
    for hop in placement.hops(step):
      for d, e, t in hop.pairs:
        assert placement.stages[d, hop.source] + step == t
        assert placement.stages[e, hop.dest] == t
        received[t] = received.get(t, 0) + 1
      assert len({d for d, _, _ in hop.pairs}) == len(hop.pairs)
      assert len({e for _, e, _ in hop.pairs}) == len(hop.pairs)
    ends = {0, S - 1} - {S - 1 if step == 1 else 0}
    assert received == {t: 1 for t in range(S) if t not in ends}


def test_bad_placements_are_refused_in_one_line():
  schedule = _schedule("1f1b")
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4, seed=4), 4)
  with pytest.raises(ValueError, match=re.escape(
      "3 devices on 'stage' is invalid for 4 stages; valid: a divisor of 4")):
    executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                      optax.sgd(0.5), _mesh(1, 3))
  with pytest.raises(ValueError, match="unknown placement 'ring'; valid: "
                     "consecutive, loop, v"):
    executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                      optax.sgd(0.5), _mesh(1, 2), placement="ring")
  with pytest.raises(ValueError, match=re.escape(
      "4 devices on 'stage' is invalid for 6 stages; valid: a divisor of 6")):
    placement_lib.make("v", 6, 4)


@pytest.mark.slow
def test_launch_with_stage_devices_trains_the_unfolded_weights(tmp_path):
  """`launch.py --config.stage_devices=1` (the 4 stages on one device per
  replica) writes the params the 4-device run writes, to rounding: XLA
  compiles the two programs' matmuls differently (1e-9 after 8 Adam
  steps here)."""
  import launching  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  got = []
  for devices in (0, 1):
    workdir = tmp_path / f"devices{devices}"
    run = launching.launch("--config=configs/pipedream.py",
                           "--config.num_steps=8",
                           f"--config.stage_devices={devices}",
                           workdir=workdir)
    assert run.returncode == 0, run.stderr[-2000:]
    with np.load(workdir / "params.npz") as f:
      got.append(dict(f))
  assert got[0].keys() == got[1].keys()
  for key in got[0]:
    np.testing.assert_allclose(got[0][key], got[1][key], rtol=1e-5,
                               atol=1e-8)
