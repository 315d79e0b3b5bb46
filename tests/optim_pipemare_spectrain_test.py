"""Tests of the SpecTrain and PipeMare wrappers against NumPy renderings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp

D, STEPS, LR, MU, K, GAMMA = 5, 8, 0.05, 0.9, 5, 0.7
AHEAD = (0, 3, 1, 2, 0, 4, 2, 1)  # SpecTrain's s per step
TAU = (3, 3, 0, 1, 5, 2, 4, 3)  # PipeMare's forward delay per step
SINCE = (0, 2, 1, 0, 3, 1, 2, 4)  # PipeMare's tau_fwd - tau_bkwd per step
assert len(AHEAD) == len(TAU) == len(SINCE) == STEPS


def _problem():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(8, D)).astype(np.float32)
  ys = rng.normal(size=(STEPS, 8)).astype(np.float32)
  c = np.array([0.5, 2.0, 1.0], np.float32)  # leaf "b": sum(c b^2) / 2
  return a, ys, c


def _np_grad(x, t):
  a, ys, c = _problem()
  return {"w": a.T @ (a @ x["w"] - ys[t]), "b": c * x["b"]}


def _jax_loss(x, y):
  a, _, c = _problem()
  return 0.5 * jnp.sum((a @ x["w"] - y) ** 2) + 0.5 * jnp.sum(c * x["b"] ** 2)


def _x0():
  return {"w": np.linspace(-1.0, 1.0, D), "b": np.array([1.0, -0.5, 2.0])}


class _NpSGD:
  """`optax.sgd(LR, MU)` in float64."""

  def __init__(self):
    self.buf = None

  def __call__(self, g):
    self.buf = g if self.buf is None else MU * self.buf + g
    return -LR * self.buf


class _NpAdam:
  """`optax.adam(LR)` in float64 (b1 0.9, b2 0.999, eps 1e-8)."""

  def __init__(self):
    self.m = self.v = 0.0
    self.t = 0

  def __call__(self, g):
    self.t += 1
    self.m = 0.9 * self.m + 0.1 * g
    self.v = 0.999 * self.v + 0.001 * g * g
    m_hat = self.m / (1 - 0.9 ** self.t)
    v_hat = self.v / (1 - 0.999 ** self.t)
    return -LR * m_hat / (np.sqrt(v_hat) + 1e-8)


INNER = {"sgd": (lambda: optax.sgd(LR, MU), _NpSGD),
         "adam": (lambda: optax.adam(LR), _NpAdam)}


def _np_run(make_inner, rule):
  """Runs `rule(t, x, inner_per_leaf, memory) -> (x_hat, x_next)`."""
  x = _x0()
  inner = {k: make_inner() for k in x}
  memory = {k: np.zeros_like(v) for k, v in x.items()}
  x_hats, xs = [], [x]
  for t in range(STEPS):
    x_hat, x = rule(t, x, inner, memory)
    x_hats.append(x_hat)
    xs.append(x)
  return x_hats, xs


def _np_spectrain(make_inner):
  """SpecTrain: x_hat = x + s u_last; u = the inner step."""
  def rule(t, x, inner, last):
    x_hat = {k: x[k] + AHEAD[t] * last[k] for k in x}
    g = _np_grad(x_hat, t)
    for k in x:
      last[k] = inner[k](g[k])
    return x_hat, {k: x[k] + last[k] for k in x}
  return _np_run(make_inner, rule)


def _np_pipemare(make_inner, warmup_steps=K, gamma=GAMMA, count_from=1):
  """PipeMare T1 (tau^-(1 - min((t + c)/K, 1))) and T2 (w - b delta)."""
  def rule(t, x, inner, delta):
    x_hat = {k: x[k] - SINCE[t] * delta[k] for k in x}
    g = _np_grad(x_hat, t)
    power = (1 - min((t + count_from) / warmup_steps, 1) if warmup_steps
             else 0)
    scale = max(TAU[t], 1) ** -power
    x_next = {}
    for k in x:
      u = scale * inner[k](g[k])
      delta[k] = gamma * delta[k] + (1 - gamma) * u
      x_next[k] = x[k] + u
    return x_hat, x_next
  return _np_run(make_inner, rule)


def _jax_run(wrapper, predict_arg, counts, update_arg=None):
  """The same loop with the wrapper, jitted, the counts traced."""
  _, ys, _ = _problem()

  @jax.jit
  def step(x, state, y, n, tau):
    x_hat = wrapper.predict(state, x, **{predict_arg: n})
    g = jax.grad(_jax_loss)(x_hat, y)
    extra = {} if update_arg is None else {update_arg: tau}
    updates, state = wrapper.update(g, state, x, **extra)
    return x_hat, optax.apply_updates(x, updates), state

  x = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), _x0())
  state = wrapper.init(x)
  x_hats, xs = [], [x]
  for t in range(STEPS):
    x_hat, x, state = step(x, state, ys[t], jnp.int32(counts[t]),
                           jnp.int32(TAU[t]))
    x_hats.append(x_hat)
    xs.append(x)
  return x_hats, xs


def _assert_runs_close(got, want):
  for g_tree, w_tree in zip(got, want):
    for g, w in zip(g_tree, w_tree):
      jax.tree.map(lambda a, b: np.testing.assert_allclose(
          a, b, rtol=2e-5, atol=2e-6), g, w)


@pytest.mark.parametrize("staleness,arg", [("pipeline", "pipeline_ahead"),
                                           ("minibatch", "ahead")])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_spectrain_matches_numpy(inner, staleness, arg):
  make_opt, make_np = INNER[inner]
  got = _jax_run(sp.optim.SpecTrain(make_opt(), staleness=staleness), arg,
                 AHEAD)
  _assert_runs_close(got, _np_spectrain(make_np))


@pytest.mark.parametrize("count_from", [1, 0])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_pipemare_matches_numpy(inner, count_from):
  make_opt, make_np = INNER[inner]
  pm = sp.optim.PipeMare(make_opt(), warmup_steps=K, decay=GAMMA,
                         count_from=count_from)
  got = _jax_run(pm, "since_forward", SINCE, update_arg="staleness")
  _assert_runs_close(got, _np_pipemare(make_np, count_from=count_from))


def _asyncpp_lr(base_lr, epoch, step, epoch_length, lr_correction_epoch,
                num_versions):
  """AsyncPP's `adjust_learning_rate` with `--lr_correction`, constant policy.

  github.com/PluralisResearch/AsyncPP, main_with_runtime.py lines 661-663.
  """
  lr = base_lr
  if num_versions > 1:
    lr = lr / ((num_versions - 1) ** (1 - min(
        float(1 + step + epoch * epoch_length)
        / (lr_correction_epoch * epoch_length), 1)))
  return lr


def test_pipemare_t1_is_asyncpps_lr_correction():
  epoch_length, correction_epochs, num_versions = 3, 2, 5
  pm = sp.optim.PipeMare(optax.sgd(LR),
                         warmup_steps=correction_epochs * epoch_length,
                         decay=0.5)
  state, x = pm.init(jnp.zeros(D)), jnp.zeros(D)
  g = jnp.linspace(-1.0, 1.0, D)
  for t in range(3 * epoch_length):
    updates, state = jax.jit(pm.update)(g, state, x,
                                        staleness=num_versions - 1)
    lr = _asyncpp_lr(LR, t // epoch_length, t % epoch_length, epoch_length,
                     correction_epochs, num_versions)
    np.testing.assert_allclose(updates, -lr * np.asarray(g), rtol=1e-6)


def test_spectrain_with_momentum_sgd_is_spectrain_prediction():
  st = sp.optim.SpecTrain(optax.sgd(LR, momentum=MU))
  rng = np.random.default_rng(1)
  x = {"s0": jnp.ones(3), "s1": jnp.zeros(2)}
  state = st.init(x)
  for _ in range(4):
    g = jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape),
                                           jnp.float32), x)
    buf_before = optax.tree.get(state.inner_state, "trace")
    updates, state = st.update(g, state, x)
    x = optax.apply_updates(x, updates)
  for s in (0, 1, 3):
    want = sp.optim.spectrain_prediction(x, g, buf_before, learning_rate=LR,
                                         staleness=s, momentum=MU)
    got = jax.jit(st.predict)(state, x, pipeline_ahead=s)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 got, want)


def _official_s(rank, world_size, forward):
  """ntueclab/SpecTrain-PyTorch src/optimizer.py:302-306, a stage's s."""
  forward_s = rank // 2 + world_size - rank - 1
  backward_s = rank // 2
  return forward_s if forward else backward_s


def _official_predict(w, grad, buf, lr, momentum, version_diff):
  """The same file, lines 315-323: w - lr * s * (momentum * buf + grad)."""
  d_p = buf * momentum + grad
  return w - lr * version_diff * d_p


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 6])
def test_spectrain_pipeline_staleness_is_the_official_codes(N):
  schedule = sp.schedules.make("pipedream", num_stages=N, num_microbatches=1,
                               num_minibatches=3 * N, weight_stashing=False)
  for t in schedule.tasks:
    forward = schedule.kind(t).runs_forward
    assert schedule.pipeline_ahead(t) == _official_s(t.stage, N, forward)
    if t.minibatch >= N - 1:  # pipeline full: the variants differ by k // 2
      assert schedule.pipeline_ahead(t) - schedule.ahead(t) == t.stage // 2
  # Predicted weights: SpecTrain(sgd(lr, mu)) after some steps against the
  # code's arithmetic, fed the buffer before the last step (the code reads
  # it after: its forward's v is mu b_t + g_t and, after zero_grad, its
  # backward's mu b_t; stalepipe uses its README's v_{t-1} = b_t for both).
  st = sp.optim.SpecTrain(optax.sgd(LR, momentum=MU))
  rng = np.random.default_rng(N)
  w = rng.normal(size=4).astype(np.float32)
  state, buf = st.init(jnp.asarray(w)), np.zeros(4, np.float32)
  for _ in range(3):
    g = rng.normal(size=4).astype(np.float32)
    buf_before, buf = buf, MU * buf + g
    updates, state = st.update(jnp.asarray(g), state, jnp.asarray(w))
    w = np.asarray(optax.apply_updates(jnp.asarray(w), updates))
  for t in schedule.tasks:
    s = _official_s(t.stage, N, schedule.kind(t).runs_forward)
    want = _official_predict(w, g, buf_before, LR, MU, s)
    got = st.predict(state, jnp.asarray(w),
                     pipeline_ahead=schedule.pipeline_ahead(t))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(want, w - LR * s * buf, rtol=1e-6, atol=1e-6)


def _bits(a):
  return np.asarray(a).reshape(-1).view(np.uint8)


def _assert_bitwise(got, want):
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)),
               got, want)


def _after_some_updates(wrapper, **update_args):
  x = {"w": jnp.array([-0.0, 1.5, -2.0]),
       "h": jnp.array([0.5, -0.0], jnp.bfloat16)}
  state = wrapper.init(x)
  for i in range(3):
    g = {"w": jnp.array([-1.0, -2.0, 0.5]) * (i + 1),  # x_0 = -0 moves up
         "h": jnp.array([1.0, 3.0], jnp.bfloat16)}
    _, state = jax.jit(wrapper.update)(g, state, x, **update_args)
  return x, state


WRAPPERS = {
    "spectrain": (lambda: sp.optim.SpecTrain(optax.adam(0.1)),
                  "pipeline_ahead", {}),
    "pipemare": (lambda: sp.optim.PipeMare(optax.sgd(0.1, 0.9),
                                           warmup_steps=4, decay=0.5),
                 "since_forward", {"staleness": 3}),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_predict_with_zero_is_params_bit_for_bit_and_state_unchanged(name):
  make, arg, update_args = WRAPPERS[name]
  wrapper = make()
  x, state = _after_some_updates(wrapper, **update_args)
  before = jax.tree.map(np.array, state)
  for n in (0, jnp.int32(0)):
    _assert_bitwise(jax.jit(wrapper.predict)(state, x, **{arg: n}), x)
  moved = wrapper.predict(state, x, **{arg: 2})
  assert not np.array_equal(moved["w"], x["w"])  # the buffer is not zero
  assert moved["h"].dtype == jnp.bfloat16
  _assert_bitwise(state, before)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.dtype, b.dtype),
               state, wrapper.init(x))  # state dtypes never change


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_extra_keyword_arguments_are_ignored(name):
  make, arg, update_args = WRAPPERS[name]
  wrapper = make()
  x = {"w": jnp.ones(3)}
  g = {"w": jnp.full(3, 0.5)}
  state = wrapper.init(x)
  plain, _ = wrapper.update(g, state, x, **update_args)
  noisy, state = jax.jit(wrapper.update)(
      g, state, x, stale_params=x, local_updates=g, something_else=7,
      **({"staleness": jnp.int32(2)} | update_args))
  np.testing.assert_array_equal(noisy["w"], plain["w"])
  other = "since_forward" if arg == "pipeline_ahead" else "ahead"
  np.testing.assert_array_equal(
      wrapper.predict(state, x, **{arg: 1, other: 5, "stage": 2})["w"],
      wrapper.predict(state, x, **{arg: 1})["w"])


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_extra_arguments_reach_the_inner_optimizer(name):
  inner = optax.chain(sp.optim.delay_compensation(0.5, delay=0),
                      optax.sgd(0.1))
  wrapper = (sp.optim.SpecTrain(inner) if name == "spectrain" else
             sp.optim.PipeMare(inner, warmup_steps=0, decay=0.5))
  x, then = jnp.array([1.0, 2.0]), jnp.array([0.5, 2.5])
  g = jnp.array([1.0, -1.0])
  got, _ = wrapper.update(g, wrapper.init(x), x, stale_params=then)
  want, _ = inner.update(g, inner.init(x), x, stale_params=then)
  np.testing.assert_array_equal(got, want)


def test_spectrain_gradient_transformation_chains():
  st = sp.optim.SpecTrain(optax.sgd(0.1))
  opt = optax.chain(optax.clip_by_global_norm(10.0),
                    st.gradient_transformation())
  x = jnp.ones(2)
  state = opt.init(x)
  updates, state = jax.jit(opt.update)(jnp.full(2, 2.0), state, x)
  np.testing.assert_allclose(updates, [-0.2, -0.2])
  np.testing.assert_allclose(st.predict(state[1], x, pipeline_ahead=3),
                             [0.4, 0.4])


def _plain_and_wrapped(pm, opt, taus):
  """Per step: the wrapper's update and the inner update from its state."""
  x = jnp.array([1.0, -1.0, 0.25])
  state = pm.init(x)
  pairs = []
  for t, tau in enumerate(taus):
    g = jnp.array([0.5, -1.0, 2.0]) * (t + 1)
    want, _ = opt.update(g, state.inner_state, x)
    got, state = jax.jit(pm.update)(g, state, x, staleness=jnp.int32(tau))
    pairs.append((got, want))
    x = optax.apply_updates(x, got)
  return pairs


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_pipemare_step_size_is_the_inner_ones_when_t1_is_inactive(inner):
  opt = INNER[inner][0]()
  # warmup_steps=0: no rescheduling, any delay.
  for got, want in _plain_and_wrapped(
      sp.optim.PipeMare(opt, warmup_steps=0, decay=0.9), opt, (5, 2, 9)):
    np.testing.assert_array_equal(got, want)
  # a delay of 0 or 1 is not rescheduled.
  for got, want in _plain_and_wrapped(
      sp.optim.PipeMare(opt, warmup_steps=10, decay=0.9), opt, (0, 1, 1, 0)):
    np.testing.assert_array_equal(got, want)
  # after the warm-up (t + 1 >= K = 2) the step size is alpha, bit for bit.
  pairs = _plain_and_wrapped(
      sp.optim.PipeMare(opt, warmup_steps=2, decay=0.9), opt, (4, 4, 4, 4))
  np.testing.assert_allclose(pairs[0][0], pairs[0][1] / 2, rtol=1e-6)
  for got, want in pairs[1:]:
    np.testing.assert_array_equal(got, want)


def test_pipemare_decay_zero_keeps_the_last_applied_update():
  pm = sp.optim.PipeMare(optax.adam(0.1), warmup_steps=3, decay=0.0)
  x = jnp.array([1.0, -1.0])
  state = pm.init(x)
  for t in range(4):
    updates, state = pm.update(jnp.array([0.3, -0.7]) * (t + 1), state, x,
                               staleness=2)
    np.testing.assert_array_equal(state.delta, updates)
    np.testing.assert_array_equal(pm.predict(state, x, since_forward=1),
                                  x - updates)


def test_pipemare_count_saturates():
  pm = sp.optim.PipeMare(optax.sgd(1.0), warmup_steps=2, decay=0.5)
  state = pm.init(jnp.zeros(1))._replace(
      count=jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
  updates, state = pm.update(jnp.ones(1), state, jnp.zeros(1), staleness=7)
  assert int(state.count) == np.iinfo(np.int32).max
  np.testing.assert_array_equal(updates, [-1.0])


def _spectrain():
  return sp.optim.SpecTrain(optax.sgd(0.1))


def _pipemare():
  return sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2, decay=0.5)


def _call(wrapper, method, **kwargs):
  x = jnp.zeros(2)
  state = wrapper.init(x)
  if method == "predict":
    return wrapper.predict(state, x, **kwargs)
  return wrapper.update(jnp.ones(2), state, x, **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: sp.optim.SpecTrain("sgd"), "optimizer='sgd'"),
    (lambda: sp.optim.PipeMare(None, warmup_steps=1, decay=0.5),
     "optimizer=None"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=-1, decay=0.5),
     "warmup_steps=-1"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2.0, decay=0.5),
     "warmup_steps=2.0"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2, decay=1.0),
     "decay=1.0"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2, decay=-0.1),
     "decay=-0.1"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2,
                               decay=float("nan")), "decay=nan"),
    (lambda: sp.optim.PipeMare(optax.sgd(0.1), warmup_steps=2, decay=0.5,
                               count_from=2), "count_from=2"),
    (lambda: sp.optim.SpecTrain(optax.sgd(0.1), staleness="stage"),
     "staleness='stage'"),
    (lambda: _call(_spectrain(), "predict", pipeline_ahead=1.5),
     "pipeline_ahead=1.5"),
    (lambda: _call(_spectrain(), "predict", ahead=1), "pipeline_ahead=None"),
    (lambda: _call(sp.optim.SpecTrain(optax.sgd(0.1), staleness="minibatch"),
                   "predict", ahead=jnp.array([1, 2])), "ahead=Array"),
    (lambda: _call(_pipemare(), "predict", since_forward=jnp.float32(1)),
     "since_forward="),
    (lambda: _call(_pipemare(), "update"), "staleness=None"),
    (lambda: _call(_pipemare(), "update", staleness=2.5), "staleness=2.5"),
])
def test_bad_arguments_raise_one_line_value_errors(make, match):
  with pytest.raises(ValueError, match=match) as err:
    make()
  message = str(err.value)
  assert "\n" not in message and "valid:" in message


def _run_transform(opt, grads, x, **extra):
  state, update = opt.init(x), jax.jit(opt.update)
  for g in grads:
    updates, state = update(g, state, x, **extra)
    x = optax.apply_updates(x, updates)
  return x


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_works_inside_masked_and_multisteps(name):
  make, _, update_args = WRAPPERS[name]
  plain = make().gradient_transformation()
  grads = [{"a": jnp.full(2, float(i)), "b": jnp.full(3, 1.0 + i)}
           for i in range(1, 7)]
  x = {"a": jnp.ones(2), "b": jnp.ones(3)}
  masked = optax.masked(plain, {"a": True, "b": False})
  got = _run_transform(masked, grads, x, **update_args)
  a_only = _run_transform(plain, [g["a"] for g in grads], x["a"],
                          **update_args)
  np.testing.assert_array_equal(got["a"], a_only)
  np.testing.assert_allclose(got["b"], x["b"] + sum(g["b"] for g in grads))
  multi = optax.MultiSteps(plain, every_k_schedule=2)
  means = [jax.tree.map(lambda u, v: (u + v) / 2, grads[i], grads[i + 1])
           for i in range(0, len(grads), 2)]
  jax.tree.map(np.testing.assert_allclose,
               _run_transform(multi, grads, x, **update_args),
               _run_transform(plain, means, x, **update_args))
