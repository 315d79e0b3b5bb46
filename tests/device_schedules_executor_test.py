"""Device-level schedules run by the executor on their own placements.

The synchronous ones (interleaved 1F1B, looped BFS, ZB-V, DualPipeV: every
task of minibatch p reads version p) train what unpipelined training does,
and what 1F1B trains, to float32 rounding; the asynchronous ones
(pipedream-interleaved, pipedream-v) train what a NumPy recursion with their
version maps trains. On every one the executor equals the oracle running
the same table.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import reference
from stalepipe.train import build
from tests.run_path_test import tiny

ATOL, RTOL = 2e-6, 2e-5
LOOP = ("interleaved-1f1b", "looped-bfs", "pipedream-interleaved")
ASYNC = ("pipedream-interleaved", "pipedream-v")  # one micro-batch each
SYNC = tuple(n for n in sp.schedules.DEVICE_LEVEL if n not in ASYNC)


def _make(name, P, M, B=2, v=2):
  options = {"num_devices": P} if name in LOOP else {}
  M = 1 if name in ASYNC else M
  return sp.schedules.make(name, num_stages=v * P, num_microbatches=M,
                           num_minibatches=B, **options)


def _windows(num, B, M, n, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(B, M, n, 8)).astype(np.float32),
           rng.integers(0, 4, size=(B, M, n)).astype(np.int32))
          for _ in range(num)]


def _close(got, want):
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, w, atol=ATOL, rtol=RTOL)


def _drained(pipes, stage_params, windows):
  """Each pipeline's state after `windows` and a drain; in every window the
  first's loss (the executor's) equals the second's (the oracle's)."""
  states = [p.init(stage_params) for p in pipes]
  for x, y in windows:
    out = [p.step(state, x, y) for p, state in zip(pipes, states)]
    states = [state for state, _ in out]
    np.testing.assert_allclose(float(out[0][1]["loss"]),
                               float(out[1][1]["loss"]), rtol=1e-5)
  return [p.drain(state)[0] for p, state in zip(pipes, states)]


def _unpipelined(staged, optimizer, windows):
  """Plain optax on the whole model, one update per minibatch."""
  model = sp.models.unpipelined(staged)
  params, opt_state = staged.stage_params, optimizer.init(staged.stage_params)
  for x, y in windows:
    for p in range(x.shape[0]):
      grads = jax.grad(lambda w: jnp.mean(jnp.stack(
          [cross_entropy(model(w, x[p, m]), y[p, m])  # pylint: disable=cell-var-from-loop
           for m in range(x.shape[1])])))(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("name,D,P,devices", [
    pytest.param("interleaved-1f1b", 2, 2, 2, marks=pytest.mark.slow),
    pytest.param("interleaved-1f1b", 2, 4, 4, marks=pytest.mark.slow),
    pytest.param("interleaved-1f1b", 1, 4, 2, marks=pytest.mark.slow),
    pytest.param("looped-bfs", 1, 2, 1, marks=pytest.mark.slow),
    pytest.param("zb-v", 2, 2, 2, marks=pytest.mark.slow),
    pytest.param("zb-v", 2, 4, 4, marks=pytest.mark.slow),
    pytest.param("dualpipev", 1, 2, 2, marks=pytest.mark.slow),
    pytest.param("dualpipev", 1, 2, 1, marks=pytest.mark.slow)])
def test_device_level_schedules_equal_unpipelined_training(name, D, P,
                                                           devices):
  """On P devices (its placement) or folded onto `devices` of them."""
  M = 2 * P  # DualPipeV needs M >= 2P; interleaved: a multiple of M // P
  schedule = _make(name, P, M)
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  mesh = jax.make_mesh((D, devices), ("data", "stage"),
                       devices=jax.devices()[:D * devices])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.adam(0.05), mesh)
  folded = "consecutive" if devices == 1 else "loop"
  assert pipe.placement.name == (schedule.placement if devices == P
                                 else folded)
  windows = _windows(2, 2, M, 2 * D)
  state = pipe.init(staged.stage_params)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)
  state, _ = pipe.drain(state)  # ZB-V: a stage may owe the last update
  _close(pipe.params(state), _unpipelined(staged, optax.adam(0.05), windows))


@pytest.mark.slow
@pytest.mark.parametrize("name", SYNC)
def test_the_executor_equals_the_oracle_on_the_same_table(name):
  P, M, D = 2, 4, 2
  schedule = _make(name, P, M)
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=3), S)
  optimizer = optax.sgd(0.5)
  mesh = jax.make_mesh((D, P), ("data", "stage"), devices=jax.devices()[:D * P])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, mesh)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, num_replicas=D)
  one = reference.Pipeline(staged.stage_fns, cross_entropy,
                           sp.schedules.make("1f1b", num_stages=S,
                                             num_microbatches=M,
                                             num_minibatches=2),
                           optimizer, num_replicas=D)
  es, rs, os_ = _drained((pipe, ref, one), staged.stage_params,
                         _windows(3, 2, M, 2 * D))
  for r in range(D):
    _close(pipe.params(es, r), ref.params(rs, r))
    _close(pipe.params(es, r), one.params(os_, r))


@pytest.mark.slow
def test_a_whole_model_rule_on_interleaved_1f1b_equals_unpipelined_training():
  P, M = 2, 4
  schedule = _make("interleaved-1f1b", P, M)
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=2), S)
  make = lambda: optax.chain(optax.clip_by_global_norm(0.5),  # pylint: disable=unnecessary-lambda-assignment
                             optax.adamw(0.05))
  mesh = jax.make_mesh((1, P), ("data", "stage"), devices=jax.devices()[:P])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, make(),
                           mesh)
  assert pipe.optimizer_scope == "model"
  windows = _windows(2, 2, M, 2)
  state = pipe.init(staged.stage_params)
  for x, y in windows:
    state, _ = pipe.step(state, x, y)
  state, _ = pipe.drain(state)
  _close(pipe.params(state), _unpipelined(staged, make(), windows))


def test_placements_that_are_not_the_schedules_are_refused_in_one_line():
  staged = sp.models.split(sp.models.mlp(8, 6, 7, 4), 8)
  for name, devices, given, match in (
      ("zb-v", 2, None, r"2 devices on 'stage' is invalid for 'zb-v' on 4 "
       r"devices \(v placement\); valid: 4, or 1 \(folded\)"),
      ("interleaved-1f1b", 3, None, r"3 devices on 'stage' is invalid"),
      ("interleaved-1f1b", 4, "consecutive", r"placement='consecutive' is "
       r"invalid for 'interleaved-1f1b', a device-level schedule on the "
       r"'loop' placement; valid: 'loop'")):
    if devices == 3:
      with pytest.raises(ValueError, match=match):
        sp.pipeline.placement.for_schedule(_make(name, 4, 8), devices, given)
      continue
    mesh = jax.make_mesh((1, devices), ("data", "stage"),
                         devices=jax.devices()[:devices])
    with pytest.raises(ValueError, match=match) as e:
      executor.Pipeline(staged.stage_fns, cross_entropy, _make(name, 4, 8),
                        optax.sgd(0.1), mesh, placement=given)
    assert "\n" not in str(e.value)


def _config(name, **overrides):
  config = tiny(schedule=name, placement="loop" if name in LOOP else "v",
                num_stages=4, num_chunks=2,
                num_microbatches=1 if name in ASYNC else 4, num_replicas=1)
  config.model_kwargs.num_hidden_layers = 3
  config.update(overrides)
  return config


@pytest.mark.parametrize("name", sp.schedules.DEVICE_LEVEL)
def test_a_config_runs_the_schedule_on_its_placement(name):
  parts = build.parts(_config(name))
  assert parts.mesh.shape["stage"] == parts.schedule.num_devices == 2
  assert parts.pipeline.placement.name == parts.schedule.placement


@pytest.mark.parametrize("overrides,message", [
    ({"placement": "consecutive"}, "placement='consecutive' is invalid for "
     "'zb-v', a device-level schedule on the 'v' placement; valid: 'v'"),
    ({"num_chunks": 4}, "num_chunks=4 is invalid for 'zb-v' with "
     "num_stages=4; valid: 2 (its v placement's chunks a device)"),
    ({"stage_devices": 4}, "4 devices on 'stage' is invalid for 'zb-v' on 2 "
     "devices (v placement); valid: 2, or 1 (folded)")])
def test_a_config_that_is_not_the_schedules_is_one_line(overrides, message):
  with pytest.raises(ValueError) as e:
    build.parts(_config("zb-v", **overrides))
  assert str(e.value).startswith(message) and "\n" not in str(e.value), (
      str(e.value))


def _d(name, P, s, v=2):
  """Minibatches chunk s misses in the version maps of `pipedream_v.py` and
  `pipedream_interleaved.py` (P even, gcd(P / 2, v) = 1)."""
  if name == "pipedream-v" and P % 2 == 0:
    return P - math.ceil(s / 2)
  return P - 1 - s // v


def _half_square(y, target):
  return 0.5 * jnp.mean(jnp.sum((y - target) ** 2, axis=-1))


def _numpy_pipedream_sgd(params, d, xs, targets, lr):
  """SGD through linear stages x A_s + c_s by hand: minibatch p's forward
  and backward on stage s read stage s's version max(0, p - d_s), and its
  gradient is applied to the stage's latest weights (x_{p+1} = x_p - lr
  g_p)."""
  S = len(params)
  history = [[{k: np.asarray(a, np.float64) for k, a in w.items()}]
             for w in params]
  for p, (x, target) in enumerate(zip(xs, targets)):
    w = [history[s][max(0, p - d[s])] for s in range(S)]
    h = [x]
    for s in range(S):
      h.append(h[-1] @ w[s]["A"] + w[s]["c"])
    dy = (h[-1] - target) / len(x)
    for s in reversed(range(S)):
      grad = {"A": h[s].T @ dy, "c": dy.sum(0)}
      dy = dy @ w[s]["A"].T
      history[s].append({k: history[s][-1][k] - lr * grad[k]
                         for k in grad})
  return [h[-1] for h in history]


@pytest.mark.parametrize("name,P", [("pipedream-v", 2), ("pipedream-v", 3),
                                    ("pipedream-interleaved", 2)])
def test_pipedream_on_chunks_trains_its_version_map(name, P):
  """The oracle on the table equals the recursion on the version map alone
  (d_s from the formula, not the table), drained after 3 windows."""
  n, B = 3, 4
  schedule = _make(name, P, 1, B=B)
  S = schedule.num_stages
  rng = np.random.default_rng(P)
  params = [{"A": (np.eye(n) + 0.3 * rng.normal(size=(n, n))).astype(
      np.float32), "c": (0.1 * rng.normal(size=n)).astype(np.float32)}
            for _ in range(S)]
  fns = [lambda w, x: x @ w["A"] + w["c"]] * S
  windows = [(rng.normal(size=(B, 1, 2, n)).astype(np.float32),
              rng.normal(size=(B, 1, 2, n)).astype(np.float32))
             for _ in range(3)]
  ref = reference.Pipeline(fns, _half_square, schedule, optax.sgd(0.1))
  state = ref.init(params)
  for x, y in windows:
    state, _ = ref.step(state, x, y)
  state, _ = ref.drain(state)
  xs = [x[p, 0] for x, _ in windows for p in range(B)]
  ys = [y[p, 0] for _, y in windows for p in range(B)]
  want = _numpy_pipedream_sgd(params, [_d(name, P, s) for s in range(S)],
                              xs, ys, 0.1)
  for got, w in zip(ref.params(state), want, strict=True):
    for k in w:
      np.testing.assert_allclose(got[k], w[k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name,rule,P,devices", [
    pytest.param("pipedream-v", "sgd", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", "sgd", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-v", "dc", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", "dc", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", "sgd", 4, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-v", "sgd", 2, 1, marks=pytest.mark.slow),
    pytest.param("pipedream-v", "spectrain", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-v", "wp3", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", "nesterov", 2, 2,
                 marks=pytest.mark.slow),
    pytest.param("pipedream-v", "pipemare", 2, 2, marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", "pipemare", 2, 2,
                 marks=pytest.mark.slow)])
def test_pipedream_on_chunks_executor_equals_the_oracle(name, rule, P,
                                                        devices):
  """SGD, and DC-ASGD-a, which compensates each gradient for the updates
  since its stashed version (`stale_params`), on the schedule's P devices
  or folded onto fewer, 2 replicas."""
  D = 2
  schedule = _make(name, P, 1)
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=5), S)
  rules = {"sgd": lambda: optax.sgd(0.5),
           "dc": lambda: optax.chain(sp.optim.dc_asgd_ema(1.0),
                                     optax.sgd(0.3, 0.9)),
           # SpecTrain over each chunk's own staleness (`Schedule.ahead`)
           "spectrain": lambda: sp.optim.SpecTrain(optax.sgd(0.3, 0.9),
                                                   staleness="minibatch"),
           "wp3": lambda: sp.optim.WeightPrediction(
               optax.sgd(0.3, 0.9), option=3, num_workers=D, lam=0.2),
           "nesterov": lambda: optax.chain(
               sp.optim.scale_by_async_nesterov(), optax.scale(-0.05)),
           # T1 over each chunk's own staleness; T2 (b = 0 with stashing)
           "pipemare": lambda: sp.optim.PipeMare(
               optax.sgd(0.3), warmup_steps=4, decay=0.5)}
  mesh = jax.make_mesh((D, devices), ("data", "stage"),
                       devices=jax.devices()[:D * devices])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           rules[rule](), mesh)
  ref = reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           rules[rule](), num_replicas=D)
  assert pipe.placement.name == (schedule.placement if devices > 1
                                 else "consecutive")
  pipes = (pipe, ref)
  if rule == "dc":  # the rule really acts: plain momentum SGD differs
    pipes += (reference.Pipeline(staged.stage_fns, cross_entropy, schedule,
                                 optax.sgd(0.3, 0.9), num_replicas=D),)
  es, rs, *plain = _drained(pipes, staged.stage_params,
                            _windows(3, 2, 1, 2 * D))
  for r in range(D):
    _close(pipe.params(es, r), ref.params(rs, r))
  for state in plain:
    gap = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                       ref.params(rs), pipes[2].params(state))
    assert max(jax.tree.leaves(gap)) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipedream-v", "pipedream-interleaved"])
def test_basis_rotation_on_chunks_equals_the_fold_onto_one_device(name):
  """Basis rotation turns rounding into steps where a gradient is rank-
  deficient (docs/optim.md), so, as for folding (`folding_test.py`), it is
  held in float64 to the same table folded onto one device, on the
  schedule's own devices with each tick (slots, lanes)."""
  schedule = _make(name, 2, 1)
  S = schedule.num_stages
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  runs = []
  with jax.enable_x64(True):
    staged = staged._replace(stage_params=jax.tree.map(
        lambda p: np.asarray(p, np.float64), staged.stage_params))
    for devices, tick in ((1, "slots"), (2, "slots"), (2, "lanes")):
      mesh = jax.make_mesh((1, devices), ("data", "stage"),
                           devices=jax.devices()[:devices])
      pipe = executor.Pipeline(
          staged.stage_fns, cross_entropy, schedule,
          sp.optim.basis_rotation_adam(0.01, precondition_frequency=2),
          mesh, tick=tick)
      state = pipe.init(staged.stage_params)
      for x, y in _windows(3, 2, 1, 2):
        state, _ = pipe.step(state, x.astype(np.float64), y)
      runs.append(pipe.params(state))
  start = jax.tree.leaves(staged.stage_params)
  assert max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(runs[0]), start, strict=True)) > 1e-3  # it trained
  for other in runs[1:]:
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(other),
                    strict=True):
      np.testing.assert_allclose(a, b, atol=1e-10, rtol=1e-10)
