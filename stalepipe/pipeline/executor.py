"""The shard_map executor: one jitted SPMD program runs a whole schedule.

The mesh has axes ('data', 'stage'). Each stage's parameters and optimizer
state live on its 'stage' slice, packed into flat per-dtype buffers
(`packing.py`) so that stages of different structure share one program. A
`lax.scan` over ticks runs, on every stage, the task its row of the
instruction tables names (`program.py`):

- F: the stage function on the input (stage 0: the window's inputs; others:
  the activation buffer slot), sending the output to the next stage;
- B: the backward, recomputing the forward from the stashed input, with the
  cotangent from the next stage (last stage: the loss) and sending the input's
  cotangent to the previous stage; parameter gradients accumulate;
- FB: forward and backward fused on the last stage;
- update: at the end of the tick in which the stage's last backward of a
  minibatch finishes, gradients are averaged over 'data' and the optimizer
  steps.

Activations and cotangents move one hop per tick with `ppermute` along
'stage' and wait in per-stage buffers until their task runs.
"""

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stalepipe.pipeline import packing
from stalepipe.pipeline import program as program_lib
from stalepipe.schedules import Schedule

DATA, STAGE = "data", "stage"


class PipelineState(NamedTuple):
  """Everything a pipeline carries between windows."""

  params: packing.Flat  # dtype -> [D, S, L]: stage s's weights on replica d
  opt_state: packing.Flat  # dtype -> [D, S, L_opt]
  step: jax.Array  # int32 []: windows run so far


class Pipeline:
  """Runs `schedule` over `mesh` with `optimizer` applied per stage.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`; stages may differ.
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters.
    mesh: a mesh with axes ('data', 'stage'); its 'stage' size must be S.

  Examples:
    >>> import jax, optax, stalepipe as sp
    >>> staged = sp.models.split(sp.models.mlp(64, 32, 3, 10), 4)
    >>> mesh = jax.make_mesh((2, 4), ("data", "stage"))
    >>> schedule = sp.schedules.make("gpipe", num_stages=4, num_microbatches=4)
    >>> pipe = Pipeline(staged.stage_fns, optax.softmax_cross_entropy_with_integer_labels,
    ...                 schedule, optax.sgd(0.1), mesh)  # doctest: +SKIP
    >>> state = pipe.init(staged.stage_params)  # doctest: +SKIP
    >>> state, metrics = pipe.step(state, inputs_BxMxbxD, labels_BxMxb)  # doctest: +SKIP
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation,
               mesh: Mesh):
    if tuple(mesh.axis_names) != (DATA, STAGE):
      raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are invalid; "
                       f"valid: ({DATA!r}, {STAGE!r})")
    if len(stage_fns) != schedule.num_stages:
      raise ValueError(f"{len(stage_fns)} stage functions do not fit a "
                       f"schedule of {schedule.num_stages} stages")
    if mesh.shape[STAGE] != schedule.num_stages:
      raise ValueError(f"mesh 'stage' size {mesh.shape[STAGE]} does not fit "
                       f"{schedule.num_stages} stages; valid: equal sizes")
    self.stage_fns = tuple(stage_fns)
    self.loss_fn = loss_fn
    self.schedule = schedule
    self.optimizer = optimizer
    self.mesh = mesh
    self.program = program_lib.compile_program(schedule)
    self._param_packing = None
    self._opt_packing = None
    self._step_fns = {}

  @property
  def num_replicas(self) -> int:
    return self.mesh.shape[DATA]

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def init(self, stage_params: Sequence[Any]) -> PipelineState:
    """Packs S stage pytrees (and their optimizer states) onto the mesh."""
    if len(stage_params) != len(self.stage_fns):
      raise ValueError(f"{len(stage_params)} stage parameter trees do not fit "
                       f"{len(self.stage_fns)} stages")
    opt_states = [self.optimizer.init(p) for p in stage_params]
    self._param_packing = packing.Packing(stage_params)
    self._opt_packing = packing.Packing(opt_states)
    D = self.num_replicas
    shard = self._sharding(P(DATA, STAGE))

    def replicate(flat):
      return {k: jax.device_put(jnp.broadcast_to(v, (D,) + v.shape), shard)
              for k, v in flat.items()}

    return PipelineState(
        params=replicate(self._param_packing.pack_all(stage_params)),
        opt_state=replicate(self._opt_packing.pack_all(opt_states)),
        step=jax.device_put(jnp.zeros((), jnp.int32), self._sharding(P())))

  def params(self, state: PipelineState, replica: int = 0) -> tuple[Any, ...]:
    """The S stage pytrees held by data replica `replica`."""
    flat = {k: np.asarray(jax.device_get(v))[replica]
            for k, v in state.params.items()}
    return self._param_packing.unpack_all(flat)

  def step(self, state: PipelineState, inputs, targets):
    """Runs one window of the schedule.

    Args:
      state: from `init` or a previous `step`.
      inputs: `[B, M, D * b, ...]`: B minibatches of M micro-batches; the
        micro-batch axis is split over the D data replicas (b examples each).
      targets: `[B, M, D * b, ...]`, laid out like `inputs`.

    Returns:
      The new state and metrics (`loss`: mean micro-batch loss of the window).
    """
    B, M = self.schedule.num_minibatches, self.schedule.num_microbatches
    for name, array in (("inputs", inputs), ("targets", targets)):
      if np.shape(array)[:2] != (B, M) or np.shape(array)[2] % self.num_replicas:
        raise ValueError(
            f"{name} shape {np.shape(array)} is invalid; valid: [{B}, {M}, "
            f"a multiple of {self.num_replicas} data replicas, ...]")
    spec = self._sharding(P(None, None, DATA))
    inputs, targets = jax.device_put(inputs, spec), jax.device_put(targets, spec)
    key = (inputs.shape, inputs.dtype, targets.shape, targets.dtype)
    if key not in self._step_fns:
      self._step_fns[key] = self._build_step(inputs, targets)
    return self._step_fns[key](state, inputs, targets,
                               jnp.asarray(self.program.table))

  def _activation_layout(self, inputs, targets):
    """Shapes of the activations leaving stages 0..S-2, and their buffer."""
    b = inputs.shape[2] // self.num_replicas
    x = jax.ShapeDtypeStruct((b,) + inputs.shape[3:], inputs.dtype)
    shapes = []
    for fn, params in zip(self.stage_fns, self._param_packing.trees):
      x = jax.eval_shape(fn, params, x)
      shapes.append(x)
    boundary = shapes[:-1]
    width = max([int(np.prod(s.shape[1:])) for s in boundary] + [1])
    dtype = jnp.result_type(*[s.dtype for s in boundary]) if boundary else (
        jnp.float32)
    return boundary, (b, width), dtype

  def _build_step(self, inputs, targets):
    S = self.schedule.num_stages
    M = self.schedule.num_microbatches
    num_slots = self.program.num_slots
    boundary, buffer_shape, act_dtype = self._activation_layout(inputs, targets)
    pp, op = self._param_packing, self._opt_packing
    col = {name: i for i, name in enumerate(program_lib.FIELDS)}

    def to_buffer(y):
      y = y.reshape(buffer_shape[0], -1).astype(act_dtype)
      return jnp.pad(y, ((0, 0), (0, buffer_shape[1] - y.shape[1])))

    def from_buffer(s, buf):
      """Stage s's input from its buffer row (s > 0)."""
      shape = boundary[s - 1]
      n = int(np.prod(shape.shape[1:]))
      return buf[:, :n].reshape(shape.shape).astype(shape.dtype)

    def stage_task(s, carry, instr, inputs, targets):
      """Stage s's task of this tick; returns carry and the two sends."""
      params, opt_state, grads, acts, cots, loss_sum = carry
      fn = self.stage_fns[s]
      p = pp.unpack(s, params)
      mini, micro, slot = (instr[col["minibatch"]], instr[col["microbatch"]],
                           instr[col["slot"]])
      x = inputs[mini, micro] if s == 0 else from_buffer(s, acts[slot])
      zeros = jnp.zeros(buffer_shape, act_dtype)
      last = s == S - 1

      def idle():
        return carry, zeros, zeros

      def forward():
        y = fn(p, x)
        if last:
          loss = self.loss_fn(y, targets[mini, micro])
          return (params, opt_state, grads, acts, cots,
                  loss_sum + loss), zeros, zeros
        return carry, to_buffer(y), zeros

      def backward(with_loss):
        if last:
          def objective(p, x):
            return self.loss_fn(fn(p, x), targets[mini, micro]) / M
          argnums = (0,) if s == 0 else (0, 1)
          loss, g = jax.value_and_grad(objective, argnums)(p, x)
          new_loss = loss_sum + loss * M if with_loss else loss_sum
        else:
          _, vjp = jax.vjp(fn, p, x)
          g = vjp(from_buffer(s + 1, cots[slot]))
          new_loss = loss_sum
        g_flat = pp.pack(s, g[0])
        grads_new = {k: grads[k] + g_flat[k] for k in grads}
        send = to_buffer(g[1]) if s > 0 else zeros
        return (params, opt_state, grads_new, acts, cots, new_loss), zeros, send

      return jax.lax.switch(
          instr[col["kind"]],
          [idle, forward, functools.partial(backward, False),
           functools.partial(backward, True)])

    def stage_update(s, params, opt_state, grads):
      p, o, g = pp.unpack(s, params), op.unpack(s, opt_state), pp.unpack(s, grads)
      updates, o = self.optimizer.update(g, o, p)
      return pp.pack(s, optax.apply_updates(p, updates)), op.pack(s, o)

    def body(params, opt_state, inputs, targets, table):
      params = {k: v[0, 0] for k, v in params.items()}
      opt_state = {k: v[0, 0] for k, v in opt_state.items()}
      stage = jax.lax.axis_index(STAGE)
      buffers = jnp.zeros((num_slots,) + buffer_shape, act_dtype)
      carry = (params, opt_state, jax.tree.map(jnp.zeros_like, params),
               buffers, buffers, jnp.zeros((), jnp.float32))
      branches = [functools.partial(stage_task, s) for s in range(S)]
      updates = [functools.partial(stage_update, s) for s in range(S)]

      def store(buffers, slot, value):
        return jax.lax.cond(
            slot >= 0, lambda: buffers.at[slot].set(value), lambda: buffers)

      def update(carry):
        params, opt_state, grads, acts, cots, loss_sum = carry
        grads = jax.lax.pmean(grads, DATA)
        params, opt_state = jax.lax.switch(stage, updates, params, opt_state,
                                           grads)
        grads = jax.tree.map(jnp.zeros_like, grads)
        return params, opt_state, grads, acts, cots, loss_sum

      def tick(carry, rows):
        instr = rows[stage]
        carry, send_f, send_b = jax.lax.switch(stage, branches, carry, instr,
                                               inputs, targets)
        recv_f = jax.lax.ppermute(send_f, STAGE,
                                  [(s, s + 1) for s in range(S - 1)])
        recv_b = jax.lax.ppermute(send_b, STAGE,
                                  [(s + 1, s) for s in range(S - 1)])
        params, opt_state, grads, acts, cots, loss_sum = carry
        acts = store(acts, instr[col["recv_forward"]], recv_f)
        cots = store(cots, instr[col["recv_backward"]], recv_b)
        carry = params, opt_state, grads, acts, cots, loss_sum
        carry = jax.lax.cond(instr[col["update"]] == 1, update,
                             lambda c: c, carry)
        return carry, None

      carry, _ = jax.lax.scan(tick, carry, table)
      params, opt_state, _, _, _, loss_sum = carry
      num_losses = self.schedule.num_minibatches * M
      loss = jax.lax.pmean(jax.lax.psum(loss_sum, STAGE), DATA) / num_losses
      expand = lambda tree: {k: v[None, None] for k, v in tree.items()}
      return expand(params), expand(opt_state), loss

    state_spec = P(DATA, STAGE)
    mapped = jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(state_spec, state_spec, P(None, None, DATA),
                  P(None, None, DATA), P()),
        out_specs=(state_spec, state_spec, P()), check_vma=False)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step_fn(state, inputs, targets, table):
      params, opt_state, loss = mapped(state.params, state.opt_state, inputs,
                                       targets, table)
      return PipelineState(params, opt_state, state.step + 1), {"loss": loss}

    return step_fn
