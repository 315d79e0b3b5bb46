"""A GPipe baseline in the MaxText / JAX-docs style, to measure ours against.

The pipeline the JAX `shard_map` tutorial and MaxText run: S identical stages
with their parameters stacked along a leading stage axis that is sharded over
the mesh axis 'stage'; every tick every stage applies the stage function to
the activation it holds (stage 0 first takes the next micro-batch), and the
activations shift one stage on with a `ppermute`. After M+S-1 ticks the last
stage holds the M outputs. The (S-1) bubble ticks of each stage compute on
garbage, which is thrown away; the backward is `jax.grad` through the scan,
so it runs M+S-1 ticks too. Gradients are averaged over 'data' by the
transpose of the replicated parameters, and SGD steps.

Checks the baseline's loss and gradients against unpipelined training and
prints one step's time (the model's flags are `executor_common.py`'s):

  .venv/bin/python experiments/baseline_gpipe.py [--hidden=512] [--micro=8] \
      [--repeats=10] [--out_dir=DIR]

References:
  Huang et al, GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism <https://arxiv.org/abs/1811.06965>, 2019 (§2.2);
  JAX docs, "Introduction to parallel programming: shard_map", 2024;
  MaxText `layers/pipeline.py` (vmap over stages, circular shift).
"""

import functools
import time
from typing import Any, Callable, Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, STAGE = "data", "stage"
FLAGS = flags.FLAGS


def stack_stages(stage_params: Sequence[Any]) -> Any:
  """S identical stage pytrees as one pytree with a leading stage axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *stage_params)


def mlp_stage(params: Sequence[dict], x_bxH: jax.Array,
              stage: jax.Array, num_stages: int) -> jax.Array:
  """One stage of `stalepipe.models.mlp` blocks, the same code on every stage.

  Every block is `relu(x @ W + b)` except the model's last, which is affine;
  as in MaxText the stage function is shared, so the last stage picks its
  final activation with a `where` on the stage index.
  """
  for i, block in enumerate(params):
    z_bxH = x_bxH @ block["linear"]["kernel"] + block["linear"]["bias"]
    is_output = (stage == num_stages - 1) & (i == len(params) - 1)
    x_bxH = jnp.where(is_output, z_bxH, jax.nn.relu(z_bxH))
  return x_bxH


def gpipe_loss(stage_fn: Callable, loss_fn: Callable, mesh: Mesh, *,
               unroll: bool = False) -> Callable:
  """`loss(stacked_params, inputs_MxNxH, targets_MxN) -> scalar`.

  The mean of `loss_fn` over the M micro-batches, each `[N = D*b, ...]` split
  over the D data replicas, computed by the bubble-and-shift pipeline.

  .. math::
    h^{(s)}_t = f_s(h^{(s-1)}_{t-1}), \\quad t = 0 .. M+S-2, \\quad
    y_m = h^{(S-1)}_{m+S-1}

  Args:
    stage_fn: `stage_fn(params_s, x, stage, num_stages) -> y`, with `y` of
      `x`'s shape (identical stages).
    loss_fn: `loss_fn(y, target) -> scalar`, a mean over a micro-batch.
    mesh: axes ('data', 'stage').
    unroll: unroll the tick loop (so that XLA's cost analysis, which counts a
      `while` body once, sees every tick).

  Returns:
    The loss function, to differentiate with `jax.grad`.

  Examples:
    >>> mesh = jax.make_mesh((2, 4), (DATA, STAGE))  # doctest: +SKIP
    >>> loss = gpipe_loss(mlp_stage, optax.softmax_cross_entropy_with_integer_labels, mesh)  # doctest: +SKIP
  """
  S = mesh.shape[STAGE]
  shift = [(s, (s + 1) % S) for s in range(S)]

  def local_loss(params_1xP, inputs_Mxbx, targets_Mxb):
    params = jax.tree.map(lambda v: v[0], params_1xP)
    stage = jax.lax.axis_index(STAGE)
    M = inputs_Mxbx.shape[0]

    def tick(carry, t):
      state_bx, outputs_Mxbx = carry
      state_bx = jnp.where(stage == 0, inputs_Mxbx[jnp.minimum(t, M - 1)],
                           state_bx)
      state_bx = stage_fn(params, state_bx, stage, S)
      # Bubble outputs land in slot 0 before micro-batch 0 overwrites them.
      outputs_Mxbx = jax.lax.dynamic_update_index_in_dim(
          outputs_Mxbx, state_bx, jnp.maximum(t - (S - 1), 0), 0)
      return (jax.lax.ppermute(state_bx, STAGE, shift), outputs_Mxbx), None

    # The carry varies over 'stage' once shifted; say so from the start.
    init = jax.lax.pcast((jnp.zeros_like(inputs_Mxbx[0]),
                          jnp.zeros_like(inputs_Mxbx)), STAGE, to="varying")
    (_, outputs_Mxbx), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1),
                                        unroll=unroll)
    loss = jnp.mean(jax.vmap(loss_fn)(outputs_Mxbx, targets_Mxb))
    loss = jax.lax.psum(jnp.where(stage == S - 1, loss, 0.0), STAGE)
    return jax.lax.pmean(loss, DATA)

  return jax.shard_map(local_loss, mesh=mesh,
                       in_specs=(P(STAGE), P(None, DATA), P(None, DATA)),
                       out_specs=P())


class GPipeBaseline:
  """One jitted GPipe training step: the pipelined loss, its gradient, SGD.

  Args:
    stage_fn: as for `gpipe_loss`.
    loss_fn: as for `gpipe_loss`.
    optimizer: an optax transformation over the stacked parameters.
    mesh: axes ('data', 'stage').
  """

  def __init__(self, stage_fn: Callable, loss_fn: Callable,
               optimizer: optax.GradientTransformation, mesh: Mesh, *,
               unroll: bool = False):
    self.mesh = mesh
    self.optimizer = optimizer
    self.loss = gpipe_loss(stage_fn, loss_fn, mesh, unroll=unroll)
    self.grad = jax.jit(jax.value_and_grad(self.loss))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, inputs, targets):
      loss, grads = jax.value_and_grad(self.loss)(params, inputs, targets)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    self.step = step

  def init(self, stage_params: Sequence[Any]):
    """Stacks and shards the stages; returns `(params, opt_state)`."""
    params = jax.device_put(stack_stages(stage_params),
                            NamedSharding(self.mesh, P(STAGE)))
    return params, jax.jit(self.optimizer.init)(params)

  def put_batch(self, inputs_MxNx, targets_MxN):
    sharding = NamedSharding(self.mesh, P(None, DATA))
    return jax.device_put(inputs_MxNx, sharding), jax.device_put(targets_MxN,
                                                                 sharding)


def main(argv):
  """Loss against unpipelined training, and the median step time."""
  del argv
  import stalepipe as sp  # pylint: disable=import-outside-toplevel
  from stalepipe.models.losses import cross_entropy as classification_loss  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((2, 4), (DATA, STAGE))
  S, H, M, b = 4, FLAGS.hidden, FLAGS.micro, FLAGS.batch
  staged = sp.models.split(sp.models.mlp(H, H, S * FLAGS.layers - 1, H), S)
  loss_fn = classification_loss
  rng = np.random.default_rng(0)
  x = rng.normal(size=(M, 2 * b, H)).astype(np.float32)
  y = rng.integers(0, H, size=(M, 2 * b)).astype(np.int32)

  baseline = GPipeBaseline(mlp_stage, loss_fn, optax.sgd(0.1), mesh)
  params, opt_state = baseline.init(staged.stage_params)
  xs, ys = baseline.put_batch(x, y)
  loss, _ = baseline.grad(params, xs, ys)
  model = sp.models.unpipelined(staged)
  want = np.mean([loss_fn(model(staged.stage_params, x[m]), y[m])
                  for m in range(M)])
  result = {"loss": float(loss), "unpipelined_loss": float(want)}
  print(f"loss: baseline {float(loss):.6f}, unpipelined {want:.6f}")
  times = []
  for _ in range(FLAGS.repeats + 1):
    t = time.perf_counter()
    params, opt_state, loss = baseline.step(params, opt_state, xs, ys)
    jax.block_until_ready(params)
    times.append(time.perf_counter() - t)
  result["step_median_s"] = float(np.median(times[1:]))
  print(f"step: median {1e3 * result['step_median_s']:.1f} ms")
  harness.record("baseline_gpipe", result)


if __name__ == "__main__":
  # Also a library (tests, executor_common): the flags and the harness only
  # when run, where experiments/ is on the path. executor_common gives 8
  # emulated CPU devices and defines the model's flags.
  import executor_common  # pylint: disable=g-import-not-at-top,unused-import
  import harness  # pylint: disable=g-import-not-at-top
  flags.FLAGS.set_default("repeats", 10)
  harness.run(main)
