"""Every stalepipe.optim transform in an nnx.Optimizer over a model sharded with nnx.with_partitioning.

A stacked state buffer `[depth, *param]` must carry its parameter's sharding
names with the extra leading axis unsharded, `(None, *names)`: with the
parameter's own names Flax refuses to build the optimizer. Each run on a
(2, 4) mesh of emulated CPU devices, Explicit and Auto axes, must give the
numbers of the same model and optimizer unsharded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import stalepipe as sp

STEPS = 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 8)).astype(np.float32)
Y = RNG.normal(size=(8, 8)).astype(np.float32)


def _sgd():
  return optax.sgd(0.05, momentum=0.9)


def _wrapped(wrapper):
  return wrapper.gradient_transformation()


# Every public transform, chained as a user would; a (staleness) extra
# argument where the transform needs one.
CASES = {
    "stale_gradients": (lambda: optax.chain(sp.optim.stale_gradients(2),
                                            _sgd()), {}),
    "stale_gradients_per_leaf": (lambda: optax.chain(
        sp.optim.stale_gradients(lambda p: jax.tree.map(
            lambda x: int(x.ndim == 2), p)), _sgd()), {}),
    "stale_optimizer": (lambda: sp.optim.stale_optimizer(optax.adam(1e-2), 2),
                        {}),
    "dc_full_delay2": (lambda: optax.chain(
        sp.optim.stale_gradients(2),
        sp.optim.delay_compensation(0.2, form="full", delay=2), _sgd()), {}),
    "dc_diagonal_ema": (lambda: optax.chain(
        sp.optim.stale_gradients(1),
        sp.optim.delay_compensation(0.2, adaptive="ema"), _sgd()), {}),
    "dc_asgd_ema": (lambda: optax.chain(
        sp.optim.stale_gradients(1), sp.optim.dc_asgd_ema(0.2, delay=1),
        _sgd()), {}),
    "wp_option3": (lambda: _wrapped(sp.optim.WeightPrediction(
        _sgd(), 3, num_workers=2, lam=0.2)), {}),
    "wp_adam": (lambda: _wrapped(sp.optim.WeightPrediction(
        optax.adam(1e-2), 1)), {}),
    "pipemare": (lambda: _wrapped(sp.optim.PipeMare(
        _sgd(), warmup_steps=3, decay=0.5)), {"staleness": 2}),
    "spectrain": (lambda: _wrapped(sp.optim.SpecTrain(_sgd())), {}),
    "scale_by_staleness": (lambda: optax.chain(
        _sgd(), sp.optim.scale_by_staleness()), {"staleness": 3}),
    "wave_accumulation": (lambda: optax.chain(
        _sgd(), sp.optim.wave_accumulation(2)), {}),
    "variance_reduced_adam": (lambda: optax.chain(
        sp.optim.scale_by_variance_reduced_adam(4),
        optax.scale_by_learning_rate(1e-2)), {}),
    "basis_rotation": (lambda: optax.chain(
        sp.optim.stale_gradients(1),
        sp.optim.basis_rotation_adam(1e-2, precondition_frequency=2)), {}),
    "basis_rotation_uni_1st": (lambda: sp.optim.basis_rotation_adam(
        1e-2, precondition_frequency=2, rotation_geometry="uni",
        approx_source="1st"), {}),
    "async_nesterov": (lambda: optax.chain(
        sp.optim.stale_gradients(1),
        sp.optim.scale_by_async_nesterov(delay=1, num_stages=4),
        optax.scale_by_learning_rate(1e-2)), {}),
}


class _Model(nnx.Module):
  """Two layers whose params are sharded on ("fsdp", "tp") when `shard`.

  Square kernels: their gradients have full rank, so basis rotation's
  eigenbases have no degenerate (arbitrary) part.
  """

  def __init__(self, shard: bool, rngs: nnx.Rngs, dtype=jnp.float32):
    def init(base, names):
      return nnx.with_partitioning(base, names) if shard else base
    normal = nnx.initializers.normal(0.3)
    self.up = nnx.Linear(8, 8, kernel_init=init(normal, ("fsdp", "tp")),
                         bias_init=init(normal, ("tp",)), param_dtype=dtype,
                         rngs=rngs)
    self.down = nnx.Linear(8, 8, kernel_init=init(normal, (None, "tp")),
                           bias_init=init(normal, ("tp",)), param_dtype=dtype,
                           rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


def _train(name, mesh=None):
  """The model and optimizer after STEPS steps; sharded on `mesh` if given.

  Basis rotation runs in float64: in float32 its first steps divide
  rounding errors by eps where the rotated second moment is still zero, and
  sharded and unsharded products round differently.
  """
  make, extra = CASES[name]
  x64 = name.startswith("basis_rotation")
  dtype = jnp.float64 if x64 else jnp.float32
  with jax.enable_x64(x64):
    model = _Model(mesh is not None, nnx.Rngs(0), dtype)
    optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
    if mesh is not None:
      _check_annotations(optimizer, mesh)

    @nnx.jit
    def step(model, optimizer):
      loss = lambda m: jnp.mean((m(X.astype(dtype)) - Y) ** 2)  # pylint: disable=unnecessary-lambda-assignment
      optimizer.update(model, nnx.grad(loss)(model), **extra)

    for _ in range(STEPS):
      step(model, optimizer)
    if mesh is not None and mesh.axis_types[0] == AxisType.Explicit:
      _check_annotations(optimizer, mesh)  # Auto: jit places the state
  return model


def _check_annotations(optimizer, mesh):
  """Each annotated state leaf: one name per axis, and placed as named."""
  checked = 0
  for path, var in nnx.to_flat_state(nnx.state(optimizer.opt_state)):
    names = var.get_metadata().get("out_sharding")
    value = var.get_value()
    if not names or not hasattr(value, "ndim"):
      continue
    assert len(names) == value.ndim, (path, names, value.shape)
    want = jax.sharding.NamedSharding(mesh, P(*names))
    assert value.sharding.is_equivalent_to(want, value.ndim), (
        path, value.sharding, names)
    checked += 1
  assert checked


# Every rule under Explicit axes; under Auto, stale_gradients in the quick
# suite and the rest in the slow one.
@pytest.mark.parametrize("name,axis_type", [
    pytest.param(name, axis, id=f"{name}-{label}", marks=(
        () if axis == AxisType.Explicit or name == "stale_gradients"
        else pytest.mark.slow))
    for name in sorted(CASES)
    for axis, label in ((AxisType.Explicit, "explicit"), (AxisType.Auto, "auto"))])
def test_sharded_nnx_model_trains_like_unsharded(name, axis_type):
  plain_model = _train(name)
  mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    model = _train(name, mesh)
  want = nnx.to_flat_state(nnx.state(plain_model, nnx.Param))
  got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for path, var in want:
    np.testing.assert_allclose(np.asarray(got[path].get_value()),
                               np.asarray(var.get_value()), rtol=2e-5,
                               atol=2e-6, err_msg=str(path))


def test_stacked_buffer_names_its_extra_axis_unsharded():
  mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
  with jax.set_mesh(mesh):
    model = _Model(True, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.chain(
        sp.optim.stale_gradients(1), sp.optim.delay_compensation(0.1),
        optax.sgd(0.1)), wrt=nnx.Param)
  stale, dc, _ = opt.opt_state
  assert stale.buffer["up"]["kernel"].get_metadata("out_sharding") == (
      None, "fsdp", "tp")
  assert dc.history["up"]["bias"].get_metadata("out_sharding") == (None, "tp")
  assert dc.history["down"]["kernel"].get_metadata("out_sharding") == (
      None, None, "tp")


def test_optimizer_sharding_annotation_gets_the_extra_axis_too():
  param = nnx.Param(jnp.zeros((4, 8)), out_sharding=("a", "b"),
                    optimizer_sharding=("a", None), eager_sharding=False)
  buffer = sp.optim.stale_gradients(2).init({"w": param}).buffer["w"]
  assert buffer.get_metadata("out_sharding") == (None, "a", "b")
  assert buffer.get_metadata("optimizer_sharding") == (None, "a", None)
  assert buffer.get_value().shape == (2, 4, 8)


def test_linen_partitioned_box_gets_an_unsharded_leading_axis():
  params = {"w": nn.Partitioned(jnp.zeros((4, 8)), names=(None, "tp")),
            "b": nn.Partitioned(jnp.zeros(8), names=("tp",))}
  state = optax.chain(sp.optim.stale_gradients(1),
                      sp.optim.delay_compensation(0.1)).init(params)
  specs = nn.get_partition_spec(state)
  assert specs[0].buffer == {"w": P(None, None, "tp"), "b": P(None, "tp")}
  assert specs[1].history == {"w": P(None, None, "tp"), "b": P(None, "tp")}
