"""Basis rotation against a NumPy port of the official code's optimizer step.

The port follows github.com/joonkyoo/basis-rotation `optim/basis_rotation.py`
(`BasisRotation.step` and the basis estimation it calls) line by line, and
`torch.optim.AdamW` for the parameters that code does not rotate, in float64.
Square leaves (and one-sided rotations of the short side) keep every
eigenvalue distinct, so the bases are defined up to sign, which cancels.
The JAX side runs in float64 too: at the first step a two-sided rotation
diagonalises G exactly, so its off-diagonal second moments are zero and the
update there is rounding error over eps, O(1) in float32 (in the official
code as well); in float64 it is 1e-8 of the step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import stalepipe as sp

LR, WD, B1, B2, EPS, STEPS, FREQ = 1e-2, 0.01, 0.9, 0.999, 1e-8, 12, 3


class _NpBasisRotation:
  """`BasisRotation` (one 2-D parameter) with its state dict, in NumPy."""

  def __init__(self, geometry, source, shampoo_beta=-1.0):
    self.geometry, self.source, self.shampoo_beta = geometry, source, shampoo_beta
    self.state = {}

  def step(self, p, grad):
    state = self.state
    if not state:
      state["step"] = 0
      state["exp_avg"] = np.zeros_like(grad)
      state["exp_avg_sq"] = np.zeros_like(grad)
      self._init_preconditioner(grad)
    state["step"] += 1
    if self.source == "2nd":
      beta = self.shampoo_beta if self.shampoo_beta >= 0 else B2
      if state["GG_L"] is not None:
        state["GG_L"] += (1 - beta) * (grad @ grad.T - state["GG_L"])
      if state["GG_R"] is not None:
        state["GG_R"] += (1 - beta) * (grad.T @ grad - state["GG_R"])
    if state["step"] % FREQ == 0 or state["Q_L"] is None:
      target = B1 * state["exp_avg"] + (1 - B1) * grad
      self._update_preconditioner(grad, target)
    grad_rotated = self._project(grad)
    state["exp_avg"] = B1 * state["exp_avg"] + (1 - B1) * grad
    rotated_momentum = self._project(state["exp_avg"])
    state["exp_avg_sq"] = B2 * state["exp_avg_sq"] + (1 - B2) * grad_rotated**2
    denom = np.sqrt(state["exp_avg_sq"]) + EPS
    step_size = LR * np.sqrt(1 - B2 ** state["step"]) / (1 - B1 ** state["step"])
    p = p - LR * WD * p
    return p - step_size * self._project_back(rotated_momentum / denom)

  def _sides(self, grad):
    rows, cols = grad.shape
    return (self.geometry == "bi" or rows < cols,
            self.geometry == "bi" or rows >= cols)

  def _project(self, x):
    if self.state["Q_L"] is not None:
      x = self.state["Q_L"].T @ x
    if self.state["Q_R"] is not None:
      x = x @ self.state["Q_R"]
    return x

  def _project_back(self, x):
    if self.state["Q_R"] is not None:
      x = x @ self.state["Q_R"].T
    if self.state["Q_L"] is not None:
      x = self.state["Q_L"] @ x
    return x

  def _init_preconditioner(self, grad):
    rows, cols = grad.shape
    use_left, use_right = self._sides(grad)
    self.state.update(Q_L=None, Q_R=None, GG_L=None, GG_R=None)
    if self.source == "2nd":
      if use_left:
        self.state["GG_L"] = np.zeros((rows, rows))
      if use_right:
        self.state["GG_R"] = np.zeros((cols, cols))

  def _update_preconditioner(self, grad, momentum):
    state, (rows, cols) = self.state, grad.shape
    use_left, use_right = self._sides(grad)
    warm = state["Q_L"] is not None if use_left else True
    if use_right:
      warm = warm and state["Q_R"] is not None
    mats, orths, dims = [], [], []
    if self.source == "2nd":
      if use_left:
        mats.append(state["GG_L"])
        orths.append(state["Q_L"] if state["Q_L"] is not None
                     else np.eye(rows))
        dims.append(0)
      if use_right:
        mats.append(state["GG_R"])
        orths.append(state["Q_R"] if state["Q_R"] is not None
                     else np.eye(cols))
        dims.append(1)
    elif not warm:
      mats = [momentum]
    else:
      if use_left:
        mats.append(momentum)
        orths.append(state["Q_R"] if state["Q_R"] is not None
                     else np.eye(cols))
        dims.append(0)
      if use_right:
        mats.append(momentum.T)
        orths.append(state["Q_L"] if state["Q_L"] is not None
                     else np.eye(rows))
        dims.append(1)
    new = self._warm(mats, orths, dims) if warm else self._cold(mats)
    if self.source == "1st" and not warm:
      if use_left:
        state["Q_L"] = new[0]
      if use_right:
        state["Q_R"] = new[1]
      return
    i = 0
    if use_left:
      state["Q_L"], i = new[i], i + 1
    if use_right:
      state["Q_R"] = new[i]

  def _cold(self, mats):
    out = []
    for m in mats:
      if self.source == "1st":
        u, _, vh = np.linalg.svd(m, full_matrices=True)
        out += [u, vh.T]
      else:
        _, q = np.linalg.eigh(m + 1e-30 * np.eye(m.shape[0]))
        out.append(np.flip(q, 1))
    return out

  def _warm(self, mats, orths, dims):
    exp_avg_sq, out = self.state["exp_avg_sq"], []
    for m, o, dim in zip(mats, orths, dims):
      if self.source == "1st":
        order = np.argsort(-np.sum((m @ o) ** 2, axis=0), kind="stable")
        k = order.shape[0]
        if dim == 1:
          exp_avg_sq = np.concatenate([exp_avg_sq[:k][order],
                                       exp_avg_sq[k:]], 0)
        else:
          exp_avg_sq = np.concatenate([exp_avg_sq[:, :k][:, order],
                                       exp_avg_sq[:, k:]], 1)
        out.append(np.linalg.qr(m @ o[:, order], mode="complete")[0])
      else:
        order = np.argsort(-np.diag(o.T @ m @ o), kind="stable")
        exp_avg_sq = np.take(exp_avg_sq, order, axis=dim)
        out.append(np.linalg.qr(m @ o[:, order])[0])
    self.state["exp_avg_sq"] = exp_avg_sq
    return out


class _NpAdamW:
  """`torch.optim.AdamW` for one parameter, in NumPy."""

  def __init__(self):
    self.m = self.v = 0.0
    self.t = 0

  def step(self, p, g):
    self.t += 1
    p = p * (1 - LR * WD)
    self.m = B1 * self.m + (1 - B1) * g
    self.v = B2 * self.v + (1 - B2) * g * g
    denom = np.sqrt(self.v) / np.sqrt(1 - B2**self.t) + EPS
    return p - LR / (1 - B1**self.t) * self.m / denom


def _problem(shape, seed):
  rng = np.random.default_rng(seed)
  if len(shape) == 1:
    scale, targets = rng.uniform(0.5, 2.0, size=shape), rng.normal(
        size=(STEPS, *shape))
    return rng.normal(size=shape), lambda w, t: scale * (w - targets[t])
  left = rng.normal(size=(shape[0], shape[0]))
  right = rng.normal(size=(shape[1], shape[1]))
  targets = rng.normal(size=(STEPS, *shape))
  # G = P (W - C_t) S with P, S positive definite: curvature off the axes.
  grad = lambda w, t: (left @ left.T + np.eye(shape[0])) @ (w - targets[t]) @ (  # pylint: disable=unnecessary-lambda-assignment
      right @ right.T + np.eye(shape[1])) / shape[0]
  return rng.normal(size=shape), grad


def _params_and_grads(shapes):
  problems = {k: _problem(s, i) for i, (k, s) in enumerate(shapes.items())}
  x0 = {k: w for k, (w, _) in problems.items()}
  grad = lambda x, t: {k: problems[k][1](x[k], t) for k in x}  # pylint: disable=unnecessary-lambda-assignment
  return x0, grad


def _np_run(shapes, geometry, source, rotate):
  x, grad = _params_and_grads(shapes)
  opts = {k: _NpBasisRotation(geometry, source) if k in rotate else _NpAdamW()
          for k in shapes}
  xs = []
  for t in range(STEPS):
    g = grad(x, t)
    x = {k: opts[k].step(x[k], g[k]) for k in x}
    xs.append(x)
  return xs


def _jax_run(shapes, opt, dtype=jnp.float64):
  x0, grad = _params_and_grads(shapes)
  with jax.enable_x64(dtype == jnp.float64):
    x = jax.tree.map(lambda v: jnp.asarray(v, dtype), x0)
    state, update = opt.init(x), jax.jit(opt.update)
    xs = []
    for t in range(STEPS):
      g = grad(jax.tree.map(np.asarray, x), t)
      updates, state = update(jax.tree.map(lambda v: jnp.asarray(v, dtype), g),
                              state, x)
      x = optax.apply_updates(x, updates)
      xs.append(jax.tree.map(np.asarray, x))
  return xs


@pytest.mark.parametrize("geometry, source, shapes", [
    ("bi", "2nd", {"w": (4, 4), "b": (4,)}),
    ("uni", "2nd", {"wide": (3, 5), "tall": (5, 3), "b": (3,)}),
    ("bi", "1st", {"w": (4, 4), "b": (4,)}),
    ("uni", "1st", {"wide": (3, 5), "tall": (5, 3), "b": (3,)}),
])
def test_matches_numpy_port_of_the_official_step(geometry, source, shapes):
  rotate = [k for k, s in shapes.items() if len(s) == 2]
  opt = sp.optim.basis_rotation_adam(
      LR, B1, B2, EPS, WD, precondition_frequency=FREQ,
      rotation_geometry=geometry, approx_source=source)
  got, want = _jax_run(shapes, opt), _np_run(shapes, geometry, source, rotate)
  for t, (g, w) in enumerate(zip(got, want)):
    for k in shapes:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-7, atol=1e-8,
                                 err_msg=f"step {t}, leaf {k}")


def test_masked_out_matrix_gets_adamw_as_the_code_gives_embeddings():
  shapes = {"attn": (4, 4), "embed": (4, 4), "b": (4,)}
  opt = sp.optim.basis_rotation_adam(
      LR, B1, B2, EPS, WD, precondition_frequency=FREQ,
      mask={"attn": True, "embed": False, "b": False})
  state = opt.init({k: jnp.zeros(s) for k, s in shapes.items()})
  assert state[0].left_basis["embed"] == optax.MaskedNode()
  got, want = _jax_run(shapes, opt), _np_run(shapes, "bi", "2nd", ["attn"])
  for g, w in zip(got, want):
    for k in shapes:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-7, atol=1e-8)


def test_state_shapes_and_what_each_option_keeps():
  params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros(5), "s": jnp.zeros(())}
  bi = sp.optim.scale_by_basis_rotation().init(params)
  assert bi.left_cov["w"].shape == bi.left_basis["w"].shape == (3, 3)
  assert bi.right_cov["w"].shape == bi.right_basis["w"].shape == (5, 5)
  assert bi.left_basis["b"] == bi.right_basis["s"] == optax.MaskedNode()
  uni = sp.optim.scale_by_basis_rotation(rotation_geometry="uni",
                                         approx_source="1st").init(params)
  assert uni.left_basis["w"].shape == (3, 3)
  assert uni.right_basis["w"] == optax.MaskedNode()
  assert uni.left_cov["w"] == uni.right_cov["w"] == optax.MaskedNode()


def test_composes_with_stale_gradients_under_jit():
  opt = optax.chain(sp.optim.stale_gradients(2),
                    sp.optim.basis_rotation_adam(1e-2, weight_decay=0.0))
  x = {"w": jnp.ones((3, 3)), "b": jnp.ones(3)}
  state, update = opt.init(x), jax.jit(opt.update)
  for t in range(4):
    g = jax.tree.map(lambda v, t=t: v * (t + 1.0), x)
    updates, state = update(g, state, x)
    if t < 2:  # warm-up: the stale ring emits zeros, the rotation passes
      jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0 * u),
                   updates)
    x = optax.apply_updates(x, updates)
  assert all(np.isfinite(v).all() for v in jax.tree.leaves(x))


def test_works_inside_masked_multisteps_and_inject_hyperparams():
  # float64: in float32 the first step's rounding noise (see the module
  # docstring) differs between differently fused programs.
  rng = np.random.default_rng(5)
  x = {"w": rng.normal(size=(3, 3)), "b": np.ones(3)}
  grads = [jax.tree.map(lambda v, t=t: np.sin(v * (t + 1.0)), x)
           for t in range(4)]

  def run(opt):
    with jax.enable_x64(True):
      y = jax.tree.map(jnp.asarray, x)
      state, update = opt.init(y), jax.jit(opt.update)
      for g in grads:
        updates, state = update(jax.tree.map(jnp.asarray, g), state, y)
        y = optax.apply_updates(y, updates)
      return jax.tree.map(np.asarray, y)

  plain = run(sp.optim.basis_rotation_adam(1e-2))
  injected = run(optax.inject_hyperparams(
      sp.optim.basis_rotation_adam, static_args=("precondition_frequency",))(
          learning_rate=1e-2))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               injected, plain)
  masked = run(optax.masked(sp.optim.basis_rotation_adam(1e-2),
                            {"w": True, "b": False}))
  np.testing.assert_allclose(masked["w"], plain["w"], rtol=1e-6)
  np.testing.assert_allclose(masked["b"], x["b"] + sum(g["b"] for g in grads))
  accumulated = run(optax.MultiSteps(sp.optim.basis_rotation_adam(1e-2), 2))
  assert all(np.isfinite(v).all() for v in jax.tree.leaves(accumulated))


def test_orbax_round_trip_continues_bit_for_bit(tmp_path):
  opt = sp.optim.basis_rotation_adam(1e-2, precondition_frequency=2,
                                     rotation_geometry="uni")
  x = {"wide": jnp.ones((2, 3)), "tall": jnp.ones((3, 2)), "b": jnp.ones(2)}
  update = jax.jit(opt.update)

  def run(x, state, start, steps):
    for t in range(start, start + steps):
      g = jax.tree.map(lambda v, t=t: jnp.cos(v * (t + 1.0)) + 0.1 * t, x)
      updates, state = update(g, state, x)
      x = optax.apply_updates(x, updates)
    return x, state

  x, state = run(x, opt.init(x), 0, 3)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", (x, state))
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(
        ocp.utils.to_shape_dtype_struct, (x, state)))
  jax.tree.map(np.testing.assert_array_equal, run(*restored, 3, 4),
               run(x, state, 3, 4))


@pytest.mark.parametrize("kwargs, match", [
    ({"precondition_frequency": -1}, "precondition_frequency=-1"),
    ({"precondition_frequency": 0}, "precondition_frequency=0"),
    ({"precondition_frequency": 2.5}, "precondition_frequency=2.5"),
    ({"rotation_geometry": "tri"}, "rotation_geometry='tri'"),
    ({"approx_source": "3rd"}, "approx_source='3rd'"),
    ({"b1": 1.0}, "b1=1.0"),
    ({"shampoo_beta": -1.0}, "shampoo_beta=-1.0"),
])
def test_bad_arguments_raise_one_line_value_errors(kwargs, match):
  with pytest.raises(ValueError, match=match) as err:
    sp.optim.scale_by_basis_rotation(**kwargs)
  assert "\n" not in str(err.value) and "valid:" in str(err.value)


def test_mask_on_a_vector_is_refused():
  opt = sp.optim.scale_by_basis_rotation(mask={"w": True, "b": True})
  with pytest.raises(ValueError, match=r"shape \(3,\); valid: 2-D"):
    opt.init({"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)})


def test_named_mask_rotates_what_the_official_code_rotates():
  """attention and MLP kernels; not the embeddings, head, norms or biases."""
  from configs.experiments import staleness_depth  # pylint: disable=g-import-not-at-top
  from stalepipe.train import build  # pylint: disable=g-import-not-at-top
  config = staleness_depth.get_config("method=basis_rotation,stages=2")
  config.model_kwargs.num_layers = 2
  run = build.parts(config)
  rotated = set()
  for s, tree in enumerate(run.staged.stage_params):
    picked = sp.optim.attention_mlp(tree)
    for path, on in jax.tree_util.tree_leaves_with_path(picked):
      if on:
        rotated.add((s, jax.tree_util.keystr(path)))
  want = {(s, f"[0]['layers'][{i}]['{m}']['kernel']")
          for s, i in ((0, 1), (1, 0)) for m in ("qkv", "proj", "fc", "out")}
  assert rotated == want
  # The config names this mask; its chain keeps no basis for the head.
  transforms = dict(config.transforms)
  assert transforms["scale_by_basis_rotation"]["mask"] == "attention_mlp"
  opt = sp.optim.TRANSFORMS.make("scale_by_basis_rotation",
                                 **transforms["scale_by_basis_rotation"])
  state = opt.init(run.staged.stage_params[1])
  head = state.left_basis[0]["layers"][1]["linear"]["kernel"]
  assert isinstance(head, optax.MaskedNode)


def test_unknown_mask_name_is_one_line():
  with pytest.raises(ValueError, match="unknown mask 'heads'; valid: "
                     "all_matrices, attention_mlp"):
    sp.optim.scale_by_basis_rotation(mask="heads")


def test_group_clip_is_torchs_clip_per_param_group():
  """clip_grad_norm_ on the rotated weights, then on the rest, each alone."""
  rng = np.random.default_rng(3)
  g = {"blocks.0.qkv.kernel": rng.normal(size=(4, 6)) * 3,
       "blocks.0.fc.kernel": rng.normal(size=(4, 8)),
       "head.linear.kernel": rng.normal(size=(4, 5)) * 0.01,
       "blocks.0.qkv.bias": rng.normal(size=(6,)) * 5}
  clip = sp.optim.clip_by_group_norm(1.0, "attention_mlp")
  got, _ = clip.update(jax.tree.map(jnp.asarray, g), clip.init(g))
  want = {}
  for group in (("blocks.0.qkv.kernel", "blocks.0.fc.kernel"),
                ("head.linear.kernel", "blocks.0.qkv.bias")):
    norm = np.sqrt(sum(np.sum(g[k] ** 2) for k in group))
    for k in group:
      want[k] = g[k] * min(1.0, 1.0 / norm)
  for k in g:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
  with pytest.raises(ValueError, match="max_norm=0 is invalid"):
    sp.optim.clip_by_group_norm(0)
