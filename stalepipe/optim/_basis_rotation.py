"""Basis rotation (Jung et al., ICML 2026): Adam's moments in the curvature eigenbasis, as the official code runs it."""

from typing import Any, Callable, NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from stalepipe.optim import _buffers
from stalepipe.optim import _masks

GEOMETRIES = ("bi", "uni")
SOURCES = ("2nd", "1st")
Mask = Union[None, str, chex.ArrayTree,
             Callable[[optax.Params], chex.ArrayTree]]


class ScaleByBasisRotationState(NamedTuple):
  """State of `scale_by_basis_rotation`.

  Per leaf of shape `[rows, cols]` that is rotated; `optax.MaskedNode()`
  where a field does not apply (a side the geometry leaves alone, the
  covariances of `approx_source="1st"`, every basis of a leaf not rotated).
  """

  count: chex.Array  # [] int32, calls so far (saturating).
  mu: optax.Updates  # like params: EMA of g with b1, in the params' basis.
  nu: optax.Updates  # like params: EMA of g*g with b2, of the rotated g.
  # The matrices are float32 (float64 for float64 params), unsharded.
  left_cov: optax.Updates  # [rows, rows]: EMA of G G^T ("2nd").
  right_cov: optax.Updates  # [cols, cols]: EMA of G^T G ("2nd").
  left_basis: optax.Updates  # [rows, rows]: Q_L.
  right_basis: optax.Updates  # [cols, cols]: Q_R.


class _LeafStep(NamedTuple):
  """What one leaf's step returns: its update and new state."""

  update: chex.Array
  mu: chex.Array
  nu: chex.Array
  left_cov: Any
  right_cov: Any
  left_basis: Any
  right_basis: Any


def _check(name: str, value: Any, valid: Any, ok: bool) -> None:
  if not ok:
    raise ValueError(f"{name}={value!r} is invalid; valid: {valid}")


def _sides(shape: tuple[int, ...], geometry: str) -> tuple[bool, bool]:
  """Which sides of a `[rows, cols]` leaf are rotated (the code's use_left/right)."""
  rows, cols = shape
  return (geometry == "bi" or rows < cols), (geometry == "bi" or rows >= cols)


def _unsharded(x: chex.Array) -> chex.Array:
  """`x` replicated when its type carries an Explicit sharding, else `x`.

  The rotation multiplies whole matrices, and a product that contracts an
  Explicitly sharded axis has no defined output sharding.
  """
  if any(name is not None for name in jax.typeof(x).sharding.spec):
    return jax.sharding.reshard(x, PartitionSpec())
  return x


def _like(x: chex.Array, leaf: chex.Array) -> chex.Array:
  """`x` in `leaf`'s dtype and (Explicit) sharding."""
  spec = jax.typeof(leaf).sharding.spec
  if any(name is not None for name in spec):
    x = jax.sharding.reshard(x, spec)
  return x.astype(leaf.dtype)


def _eigenbasis(cov: chex.Array) -> chex.Array:
  """Eigenvectors of `cov`, largest eigenvalue first (the code's cold start)."""
  eye = jnp.eye(cov.shape[0], dtype=cov.dtype)
  return jnp.linalg.eigh(cov + 1e-30 * eye)[1][:, ::-1]


def _descending(values: chex.Array) -> chex.Array:
  return jnp.argsort(-values)


def _rotate_leaf(g, mu, nu, left_cov, right_cov, left_q, right_q, count, *,
                 b1, b2, cov_decay, eps, frequency, geometry, source):
  """One step of the official `BasisRotation.step` for one `[rows, cols]` leaf."""
  use_left, use_right = _sides(g.shape, geometry)
  rows, cols = g.shape
  f32 = jnp.promote_types(g.dtype, jnp.float32)
  g_ = _unsharded(g).astype(f32)
  mu_, nu_ = _unsharded(mu).astype(f32), _unsharded(nu).astype(f32)

  if source == "2nd":  # torch's lerp_(x, 1 - beta)
    if use_left:
      left_cov = left_cov + (1 - cov_decay) * (g_ @ g_.T - left_cov)
    if use_right:
      right_cov = right_cov + (1 - cov_decay) * (g_.T @ g_ - right_cov)

  target = b1 * mu_ + (1 - b1) * g_  # the momentum after this step

  def cold():
    if source == "2nd":
      return (_eigenbasis(left_cov) if use_left else left_q,
              _eigenbasis(right_cov) if use_right else right_q, nu_)
    u, _, vh = jnp.linalg.svd(target, full_matrices=True)
    return u if use_left else left_q, vh.T if use_right else right_q, nu_

  def warm():
    new_left, new_right, v = left_q, right_q, nu_
    if source == "2nd":
      if use_left:
        order = _descending(jnp.diag(left_q.T @ left_cov @ left_q))
        v = v[order, :]
        new_left = jnp.linalg.qr(left_cov @ left_q[:, order])[0]
      if use_right:
        order = _descending(jnp.diag(right_q.T @ right_cov @ right_q))
        v = v[:, order]
        new_right = jnp.linalg.qr(right_cov @ right_q[:, order])[0]
      return new_left, new_right, v
    # "1st": a power-iteration step on the momentum, each side from the
    # other side's old basis (the identity where that side is not rotated).
    if use_left:
      other = right_q if use_right else jnp.eye(cols, dtype=f32)
      order = _descending(jnp.sum((target @ other) ** 2, axis=0))
      v = v[:, order]
      new_left = jnp.linalg.qr(target @ other[:, order], mode="complete")[0]
    if use_right:
      other = left_q if use_left else jnp.eye(rows, dtype=f32)
      order = _descending(jnp.sum((target.T @ other) ** 2, axis=0))
      v = v[order, :]
      new_right = jnp.linalg.qr(target.T @ other[:, order], mode="complete")[0]
    return new_left, new_right, v

  # The code re-estimates when `step % frequency == 0` or Q_L is unset, and a
  # one-sided rotation of a leaf with rows >= cols never sets Q_L.
  first = count == 1
  refresh = first | (count % frequency == 0) | (not use_left)
  left_q, right_q, nu_ = jax.lax.cond(
      refresh, lambda: jax.lax.cond(first, cold, warm),
      lambda: (left_q, right_q, nu_))

  def project(x):
    x = left_q.T @ x if use_left else x
    return x @ right_q if use_right else x

  def project_back(x):
    x = x @ right_q.T if use_right else x
    return left_q @ x if use_left else x

  rotated_g = project(g_)
  mu_ = b1 * mu_ + (1 - b1) * g_
  nu_ = b2 * nu_ + (1 - b2) * rotated_g ** 2
  t = count.astype(f32)
  step_size = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
  update = step_size * project_back(project(mu_) / (jnp.sqrt(nu_) + eps))
  return (_like(update, g), _like(mu_, mu), _like(nu_, nu), left_cov,
          right_cov, left_q, right_q)


def scale_by_basis_rotation(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    precondition_frequency: int = 10,
    rotation_geometry: str = "bi",
    approx_source: str = "2nd",
    shampoo_beta: Optional[float] = None,
    mask: Mask = None,
) -> optax.GradientTransformation:
  r"""Adam with its moments in a rotated basis aligned with the curvature's.

  For a matrix leaf :math:`G \in \mathbb{R}^{r \times c}`, with orthogonal
  bases :math:`Q_L, Q_R` re-estimated every `precondition_frequency` steps
  and :math:`t = 1, 2, \ldots`:

  .. math::
    L_t = \beta L_{t-1} + (1-\beta) G G^\top, \quad
    R_t = \beta R_{t-1} + (1-\beta) G^\top G, \quad
    m_t = \beta_1 m_{t-1} + (1-\beta_1) G,

    v_t = \beta_2 v_{t-1} + (1-\beta_2) (Q_L^\top G Q_R)^{\circ 2}, \qquad
    u_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,
      Q_L \frac{Q_L^\top m_t Q_R}{\sqrt{v_t} + \epsilon} Q_R^\top .

  :math:`m` stays in the params' basis and :math:`v` in the rotated one.
  The bases (`approx_source="2nd"`, the default) are the eigenvectors of
  :math:`L, R` (:math:`\beta` = `shampoo_beta`, :math:`\beta_2` if None),
  largest eigenvalue first, at the first step; at each refresh after it
  one warm-started power-iteration step replaces them: the old basis is
  sorted by its Rayleigh quotients :math:`\mathrm{diag}(Q^\top L Q)`
  (permuting :math:`v`'s rows or columns alike) and :math:`Q \leftarrow
  \mathrm{qr}(L Q)`. `approx_source="1st"` estimates them from the momentum
  after this step, :math:`\beta_1 m_{t-1} + (1-\beta_1) G`: its full SVD
  at the first step, then :math:`Q_L \leftarrow \mathrm{qr}(M Q_R)` and
  :math:`Q_R \leftarrow \mathrm{qr}(M^\top Q_L)` from the other side's old
  basis, sorted by column norms. `rotation_geometry="uni"` rotates one side
  only, the rows when :math:`r < c`, else the columns (the other basis is
  the identity); the code re-estimates such a columns-only leaf at every
  step (its refresh test reads :math:`Q_L`, which stays unset), and so does
  this transform. A Flax kernel is the transpose of a PyTorch weight:
  `"bi"` is the same either way, `"uni"` on a square leaf rotates its
  columns.

  Leaves that are not rotated (anything not 2-D, and 2-D leaves that `mask`
  leaves out) get Adam with the same :math:`\beta_1, \beta_2, \epsilon`
  (`optax.scale_by_adam`), as the official code hands every parameter it
  does not rotate to `torch.optim.AdamW`; it rotates only the weights of the
  attention and MLP linear layers, which is `mask`'s job here. Bases and
  covariances are float32 and unsharded; under Explicit sharding the
  rotation runs on replicated copies and the update is sharded like its
  leaf. Chain with `optax.add_decayed_weights(wd)` and
  `optax.scale_by_learning_rate(lr)` (`basis_rotation_adam`).

  Numerics, as in the official code: where the rotated second moment is
  still zero (at the first step a two-sided rotation diagonalises
  :math:`G`; a rank-deficient :math:`G` leaves a null space) the update is
  a rounding error divided by :math:`\epsilon`, of order one step in
  float32, and the basis of a degenerate eigenspace is whatever `eigh`
  returns. Runs that round differently (another sharding, another device)
  then differ by that much; float64 makes it negligible.

  Args:
    b1: :math:`\beta_1` (the runs' `--momentum`, 0.9).
    b2: :math:`\beta_2` (0.999 in the runs).
    eps: :math:`\epsilon`, added after the square root, before the bias
      correction of the step size.
    precondition_frequency: :math:`T_{freq}`, steps between re-estimations
      of the bases, an int >= 1 (the runs' `--subspace_update_frequency`);
      with `optax.inject_hyperparams`, name it in `static_args`.
    rotation_geometry: `"bi"` (both sides) or `"uni"` (one side).
    approx_source: `"2nd"` (gradient covariances) or `"1st"` (momentum).
    shampoo_beta: :math:`\beta` of the covariances, in [0, 1); None uses
      `b2`, as the code's default -1 does.
    mask: which 2-D leaves to rotate: a name from `MASKS`
      (`"attention_mlp"`: the official code's selection), a pytree of bools
      like the params, a callable returning one, or None for every 2-D leaf.

  Returns:
    An `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(scale_by_basis_rotation(),
    ...                   optax.scale_by_learning_rate(1e-3))
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.array([[1., 0.], [0., 2.], [0., 0.]]),
    ...          "b": jnp.array([1., -1.])}
    >>> updates, state = opt.update(grads, state)
    >>> [[round(float(v), 6) + 0.0 for v in row] for row in updates["w"]]
    [[-0.001, 0.0], [0.0, -0.001], [0.0, 0.0]]
    >>> [round(float(v), 6) for v in updates["b"]]  # 1-D: Adam
    [-0.001, 0.001]

  References:
    Jung, Shin and Lee, `Mitigating Staleness in Asynchronous Pipeline
    Parallelism via Basis Rotation <https://arxiv.org/abs/2602.03515>`_,
    ICML 2026, Algorithms 1 and 2, and its official code
    (github.com/joonkyoo/basis-rotation, `optim/basis_rotation.py` lines
    52-117 for the step, 139-354 for the bases; `optim/optimizer.py` lines
    104-132 for which parameters are rotated; `main_with_runtime.py` lines
    64, 136-142 and 337-345 for the settings of the runs).
  """
  _check("precondition_frequency", precondition_frequency, "an int >= 1",
         isinstance(precondition_frequency, int)
         and not isinstance(precondition_frequency, bool)
         and precondition_frequency >= 1)
  _check("rotation_geometry", rotation_geometry, GEOMETRIES,
         rotation_geometry in GEOMETRIES)
  _check("approx_source", approx_source, SOURCES, approx_source in SOURCES)
  for name, beta in (("b1", b1), ("b2", b2), ("shampoo_beta", shampoo_beta)):
    if isinstance(beta, (int, float)):  # injected values are arrays
      _check(name, beta, "a number in [0, 1)", 0 <= beta < 1)
  cov_decay = b2 if shampoo_beta is None else shampoo_beta
  mask = _masks.mask(mask)

  def rotated(params):
    """True on the leaves to rotate; refuses a mask on a leaf that is not 2-D."""
    if mask is None:
      return jax.tree.map(lambda p: jnp.ndim(p) == 2, params)

    def one(selected, p):
      if selected and jnp.ndim(p) != 2:
        raise ValueError(f"mask selects a leaf of shape {jnp.shape(p)}; "
                         "valid: 2-D leaves only")
      return bool(selected)
    return jax.tree.map(one, mask(params) if callable(mask) else mask, params)

  def init_fn(params):
    rot = rotated(params)

    def matrices(make, side):
      def one(p, r):
        if make is None or not r or not _sides(jnp.shape(p),
                                                rotation_geometry)[side]:
          return _buffers.absent()
        n = jnp.shape(p)[side]
        return make(n, jnp.promote_types(jnp.result_type(p), jnp.float32))
      return _buffers.unsharded_annotations(jax.tree.map(one, params, rot))

    zeros = lambda n, dtype: jnp.zeros((n, n), dtype)  # pylint: disable=unnecessary-lambda-assignment
    eye = lambda n, dtype: jnp.eye(n, dtype=dtype)  # pylint: disable=unnecessary-lambda-assignment
    covariance = zeros if approx_source == "2nd" else None
    return ScaleByBasisRotationState(
        count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
        nu=optax.tree.zeros_like(params),
        left_cov=matrices(covariance, 0), right_cov=matrices(covariance, 1),
        left_basis=matrices(eye, 0), right_basis=matrices(eye, 1))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    def adam(g, mu, nu):
      mu = optax.tree.update_moment(g, mu, b1, 1)
      nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
      m_hat = optax.tree.bias_correction(mu, b1, count)
      v_hat = optax.tree.bias_correction(nu, b2, count)
      return (m_hat / (jnp.sqrt(v_hat) + eps)).astype(g.dtype), mu, nu

    def one(g, r, mu, nu, lc, rc, lq, rq):
      if not r:
        return _LeafStep(*adam(g, mu, nu), lc, rc, lq, rq)
      return _LeafStep(*_rotate_leaf(
          g, mu, nu, lc, rc, lq, rq, count, b1=b1, b2=b2,
          cov_decay=cov_decay, eps=eps, frequency=precondition_frequency,
          geometry=rotation_geometry, source=approx_source))

    steps = jax.tree.map(one, updates, rotated(updates), state.mu, state.nu,
                         state.left_cov, state.right_cov, state.left_basis,
                         state.right_basis)
    field = lambda name: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
        lambda s: getattr(s, name), steps,
        is_leaf=lambda x: isinstance(x, _LeafStep))
    return field("update"), ScaleByBasisRotationState(
        count, optax.tree.cast_like(field("mu"), state.mu),
        optax.tree.cast_like(field("nu"), state.nu), field("left_cov"),
        field("right_cov"), field("left_basis"), field("right_basis"))

  return optax.GradientTransformation(init_fn, update_fn)


def basis_rotation_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    precondition_frequency: int = 10,
    rotation_geometry: str = "bi",
    approx_source: str = "2nd",
    shampoo_beta: Optional[float] = None,
    mask: Mask = None,
) -> optax.GradientTransformation:
  r"""The official `BasisRotation` optimizer: the rotation, weight decay, lr.

  .. math::
    x_{t+1} = x_t - \eta_t \big(u_t + w\, x_t\big)

  with :math:`u_t` from `scale_by_basis_rotation` and :math:`w` =
  `weight_decay`, decoupled as the code applies it
  (:math:`x \leftarrow x - \eta w x` before the step; the same for the
  leaves it hands to AdamW). Defaults are those of the code's runs
  (`main_with_runtime.py`: betas `(--momentum 0.9, 0.999)`, weight decay
  0.01, refresh every 10 steps, `"bi"`, `"2nd"`); the README's example uses
  lr 1e-3 with gradients clipped at 1.

  Args:
    learning_rate: :math:`\eta`, a number or an optax schedule.
    b1: :math:`\beta_1`.
    b2: :math:`\beta_2`.
    eps: :math:`\epsilon`.
    weight_decay: :math:`w \ge 0`.
    precondition_frequency: steps between re-estimations of the bases.
    rotation_geometry: `"bi"` or `"uni"`.
    approx_source: `"2nd"` or `"1st"`.
    shampoo_beta: the covariances' decay; None uses `b2`.
    mask: the 2-D leaves to rotate: a name from `MASKS`, a pytree, a
      callable, or None (all).

  Returns:
    An `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = basis_rotation_adam(1e-3, weight_decay=0.0)
    >>> x = jnp.eye(2)
    >>> updates, _ = opt.update(jnp.array([[1., 0.], [0., 3.]]), opt.init(x), x)
    >>> [round(float(v), 6) for v in jnp.diag(updates)]
    [-0.001, -0.001]

  References:
    Jung, Shin and Lee, `Mitigating Staleness in Asynchronous Pipeline
    Parallelism via Basis Rotation <https://arxiv.org/abs/2602.03515>`_,
    ICML 2026; github.com/joonkyoo/basis-rotation, `optim/basis_rotation.py`
    lines 114-117 (decay, then the step).
  """
  if isinstance(weight_decay, (int, float)):
    _check("weight_decay", weight_decay, "a number >= 0", weight_decay >= 0)
  return optax.chain(
      scale_by_basis_rotation(
          b1, b2, eps, precondition_frequency=precondition_frequency,
          rotation_geometry=rotation_geometry, approx_source=approx_source,
          shampoo_beta=shampoo_beta, mask=mask),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
