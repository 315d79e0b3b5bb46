"""The shard_map executor: one jitted SPMD program runs any schedule.

The mesh has axes ('data', 'stage'). Each stage's weight versions, optimizer
state and gradient accumulator live on its 'stage' slice, packed into flat
per-dtype buffers (`packing.py`) so that stages of different structure share
one program. A `lax.scan` over the ticks of a window runs, on every stage, the
task its row of the instruction tables names (`program.py`):

- F: the stage function on its input (stage 0: the window's inputs; others:
  the buffer slot the input arrived in), sending the output on;
- B: the backward, recomputing the forward from the kept input, with the
  cotangent from the next stage (last stage: the loss), sending the input's
  cotangent back; parameter gradients accumulate (nF1B: one backward covers
  all micro-batches of a minibatch);
- FB: forward and backward fused on the last stage;
- update: at the end of the tick in which the stage's last backward of a
  minibatch finishes, the optimizer steps and writes the new weight version
  into the stash ring; the sync policy (`stalepipe.sync`) acts around it:
  BSP averages the gradient over 'data' first, WSP pushes and pulls wave
  updates, SDPipe / AD-PSGD / local SGD average the new weights in groups.

Every task reads the weight version the schedule's version map names, from a
ring of R versions per stage (R: the schedule's stash depth). Activations and
cotangents move one hop per tick with `ppermute` along 'stage' and wait in
per-stage buffer slots until their task runs. Work in flight at the end of a
window (activations, stashes, partial gradients, inputs of minibatches not
yet finished) stays in the state, so K windows give exactly one schedule over
K*B minibatches.
"""

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stalepipe import sync as sync_lib
from stalepipe.pipeline import packing
from stalepipe.pipeline import program as program_lib
from stalepipe.schedules import Schedule

DATA, STAGE = "data", "stage"
_COL = {name: i for i, name in enumerate(program_lib.FIELDS)}


class PipelineState(NamedTuple):
  """Everything a pipeline carries between windows."""

  params: packing.Flat  # dtype -> [D, S, R, L]: weight versions in the ring
  versions: jax.Array  # int32 [D, S, R]: version held by each ring slot; -1
  latest: jax.Array  # int32 [D, S]: updates each stage has applied
  opt_state: packing.Flat  # dtype -> [D, S, L_opt]
  grads: packing.Flat  # dtype -> [D, S, L]: the minibatch being accumulated
  acts: jax.Array | None  # [D, S, C, b, A]: inputs kept for the backward
  cots: jax.Array | None  # [D, S, C, b, A]: cotangents waiting for it
  past_inputs: jax.Array | None  # [H*B, M, D*b, ...]: earlier windows'
  past_targets: jax.Array | None  # [H*B, M, D*b, ...]
  waves: dict  # WSP only: "acc" dtype -> [D, S, L] this wave's own updates;
  #   "pending" dtype -> [D, S, Q, L] global-minus-own updates not yet added,
  #   "pending_wave" int32 [D, S, Q] their wave (-1: none); Q = clock distance+1
  step: jax.Array  # int32 []: windows run so far


class Pipeline:
  """Runs `schedule` over `mesh` with `optimizer` applied per stage.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`; stages may differ.
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters.
      A `GradientTransformationExtraArgs` also receives `stale_params=`, the
      weights the gradient was computed on.
    mesh: a mesh with axes ('data', 'stage'); its 'stage' size must be S.
    sync: what crosses the 'data' axis (`stalepipe.sync`); default BSP.

  Examples:
    >>> import jax, optax, stalepipe as sp
    >>> staged = sp.models.split(sp.models.mlp(64, 32, 3, 10), 4)
    >>> mesh = jax.make_mesh((2, 4), ("data", "stage"))
    >>> schedule = sp.schedules.make("pipedream", num_stages=4, num_microbatches=4)
    >>> pipe = Pipeline(staged.stage_fns, sp.models.losses.cross_entropy,
    ...                 schedule, optax.sgd(0.1), mesh,
    ...                 sync=sp.sync.bsp(2))  # doctest: +SKIP
    >>> state = pipe.init(staged.stage_params)  # doctest: +SKIP
    >>> state, metrics = pipe.step(state, inputs_BxMxbxD, labels_BxMxb)  # doctest: +SKIP
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation,
               mesh: Mesh, sync: sync_lib.SyncPolicy | None = None):
    if tuple(mesh.axis_names) != (DATA, STAGE):
      raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are invalid; "
                       f"valid: ({DATA!r}, {STAGE!r})")
    if len(stage_fns) != schedule.num_stages:
      raise ValueError(f"{len(stage_fns)} stage functions do not fit a "
                       f"schedule of {schedule.num_stages} stages; valid: "
                       f"{schedule.num_stages}")
    if mesh.shape[STAGE] != schedule.num_stages:
      raise ValueError(f"mesh 'stage' size {mesh.shape[STAGE]} does not fit "
                       f"{schedule.num_stages} stages; valid: equal sizes")
    sync = sync or sync_lib.bsp(mesh.shape[DATA])
    if sync.num_replicas != mesh.shape[DATA]:
      raise ValueError(f"sync policy over {sync.num_replicas} replicas does not "
                       f"fit the mesh's {mesh.shape[DATA]} data replicas; "
                       f"valid: {mesh.shape[DATA]}")
    concurrent = schedule.options.get("concurrent_minibatches")
    if sync.wave and concurrent is not None and sync.wave != concurrent:
      raise ValueError(f"WSP waves of {sync.wave} minibatches do not fit the "
                       f"schedule's concurrent_minibatches={concurrent}; "
                       "valid: equal (a wave is N_m minibatches)")
    self.stage_fns = tuple(stage_fns)
    self.loss_fn = loss_fn
    self.schedule = schedule
    self.optimizer = optimizer
    self.mesh = mesh
    self.sync = sync
    self.program = program_lib.compile_program(schedule)
    self._param_packing = None
    self._opt_packing = None
    self._step_fns = {}
    self._tables = None
    self._static_plan = None

  @property
  def num_replicas(self) -> int:
    return self.mesh.shape[DATA]

  def _put(self, x, spec: P):
    """Places a value every process holds whole onto the mesh."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec),
                                        lambda index: x[index])

  def _put_local(self, x, spec: P):
    """Assembles the mesh-wide array from each process's own slice of it."""
    sharding = NamedSharding(self.mesh, spec)
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  def _fetch(self, x) -> np.ndarray:
    """The whole of a mesh-wide array, on every process."""
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def init(self, stage_params: Sequence[Any]) -> PipelineState:
    """Packs S stage pytrees (and their optimizer states) onto the mesh."""
    if len(stage_params) != len(self.stage_fns):
      raise ValueError(f"{len(stage_params)} stage parameter trees do not fit "
                       f"{len(self.stage_fns)} stages; valid: "
                       f"{len(self.stage_fns)}")
    opt_states = [self.optimizer.init(p) for p in stage_params]
    self._param_packing = packing.Packing(stage_params)
    self._opt_packing = packing.Packing(opt_states)
    D, S, R = self.num_replicas, len(self.stage_fns), self.program.num_versions
    spec = P(DATA, STAGE)

    def per_replica(flat, ring=False):
      out = {}
      for k, v in flat.items():
        v = np.asarray(v)
        if ring:  # version 0 in slot 0; the other slots empty
          v = np.zeros((S, R) + v.shape[1:], v.dtype)
          v[:, 0] = np.asarray(flat[k])
        out[k] = self._put(np.broadcast_to(v, (D,) + v.shape), spec)
      return out

    params = self._param_packing.pack_all(stage_params)
    versions = np.full((D, S, R), -1, np.int32)
    versions[..., 0] = 0
    waves = {}
    if self.sync.wave:
      Q = self.sync.clock_distance + 1
      zeros = jax.tree.map(jnp.zeros_like, params)
      waves = {"acc": per_replica(zeros),
               "pending": per_replica(
                   {k: np.zeros((S, Q) + v.shape[1:], v.dtype)
                    for k, v in zeros.items()}),
               "pending_wave": self._put(np.full((D, S, Q), -1, np.int32),
                                         spec)}
    return PipelineState(
        params=per_replica(params, ring=True),
        versions=self._put(versions, spec),
        latest=self._put(np.zeros((D, S), np.int32), spec),
        opt_state=per_replica(self._opt_packing.pack_all(opt_states)),
        grads=per_replica(jax.tree.map(jnp.zeros_like, params)),
        acts=None, cots=None, past_inputs=None, past_targets=None,
        waves=waves, step=self._put(np.zeros((), np.int32), P()))

  def params(self, state: PipelineState, replica: int = 0) -> tuple[Any, ...]:
    """The latest weights of the S stages held by data replica `replica`."""
    versions = self._fetch(state.versions)[replica]
    latest = self._fetch(state.latest)[replica]
    slots = [int(np.argmax(versions[s] == latest[s]))
             for s in range(len(self.stage_fns))]
    flat = {k: self._fetch(v)[replica][np.arange(len(slots)), slots]
            for k, v in state.params.items()}
    return self._param_packing.unpack_all(flat)

  def abstract_state(self, stage_params: Sequence[Any], inputs,
                     targets) -> PipelineState:
    """The state's structure after a step, without running one.

    Shapes, dtypes and shardings of every leaf (`jax.ShapeDtypeStruct`), e.g.
    to restore a checkpoint into; `inputs` and `targets` are laid out as for
    `step` (only their shapes matter). It places a zero state on the devices
    to read the shardings from, so it briefly takes a state's memory.
    """
    spec = P(None, None, DATA)
    state = self._allocate(self.init(stage_params),
                           self._put_local(inputs, spec),
                           self._put_local(targets, spec))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state)

  def step(self, state: PipelineState, inputs, targets):
    """Runs one window of the schedule.

    Args:
      state: from `init` or a previous `step`.
      inputs: `[B, M, D * b, ...]`: B minibatches of M micro-batches; the
        micro-batch axis is split over the D data replicas (b examples each).
        In a multi-process run, each process passes its own slice
        `[B, M, D_local * b, ...]` for the replicas on its devices.
      targets: `[B, M, D * b, ...]`, laid out like `inputs`.

    Returns:
      The new state and metrics: `loss`, the mean loss of the micro-batches
      whose forward reached the last stage in this window (NaN if none did),
      and `num_losses`, their count.
    """
    if self._param_packing is None:
      raise ValueError("step() before init(); valid: state = pipe.init("
                       "stage_params), then pipe.step(state, ...)")
    B, M = self.schedule.num_minibatches, self.schedule.num_microbatches
    local_replicas = sum(  # replica rows holding a device of this process
        any(d.process_index == jax.process_index() for d in row)
        for row in self.mesh.devices)
    for name, array in (("inputs", inputs), ("targets", targets)):
      if np.shape(array)[:2] != (B, M) or np.shape(array)[2] % local_replicas:
        raise ValueError(
            f"{name} shape {np.shape(array)} is invalid; valid: [{B}, {M}, "
            f"a multiple of {local_replicas} data replicas, ...]")
    spec = P(None, None, DATA)
    inputs, targets = self._put_local(inputs, spec), self._put_local(targets,
                                                                     spec)
    if state.acts is None:
      state = self._allocate(state, inputs, targets)
    key = (inputs.shape, inputs.dtype, targets.shape, targets.dtype)
    if key not in self._step_fns:
      self._step_fns[key] = self._build_step(inputs)
    if self._tables is None:
      self._tables = self._put(self.program.tables, P())
    return self._step_fns[key](state, inputs, targets, self._tables,
                               self._sync_plan(state))

  def _sync_plan(self, state: PipelineState) -> dict[str, jax.Array]:
    """The sync policy's plan for the updates this window can hold."""
    B, H = self.schedule.num_minibatches, self.program.history
    static = (type(self.sync).mixing is sync_lib.SyncPolicy.mixing
              and not self.sync.wave)
    if static and self._static_plan is not None:
      return self._static_plan
    window = 0 if static else int(jax.device_get(state.step))
    plan = self.sync.plan((window - H) * B, (H + 1) * B, len(self.stage_fns))
    plan = {k: self._put(v, P()) for k, v in plan.items()}
    if static:
      self._static_plan = plan
    return plan

  def _activation_layout(self, inputs):
    """Shapes of the activations leaving stages 0..S-2, and their buffer."""
    b = inputs.shape[2] // self.num_replicas
    x = jax.ShapeDtypeStruct((b,) + inputs.shape[3:], inputs.dtype)
    boundary = []
    for fn, params in zip(self.stage_fns[:-1], self._param_packing.trees):
      x = jax.eval_shape(fn, params, x)
      boundary.append(x)
    width = max([int(np.prod(s.shape[1:])) for s in boundary] + [1])
    dtype = (jnp.result_type(*[s.dtype for s in boundary]) if boundary
             else jnp.float32)
    return boundary, (b, width), dtype

  def _allocate(self, state, inputs, targets):
    """Zero activation buffers and input history, on first use."""
    _, buffer_shape, dtype = self._activation_layout(inputs)
    D, S, C = self.num_replicas, len(self.stage_fns), self.program.num_slots
    buffers = lambda: self._put(np.zeros((D, S, C) + buffer_shape, dtype),
                                P(DATA, STAGE))
    H, B = self.program.history, self.schedule.num_minibatches
    spec = P(None, None, DATA)
    past = lambda x: self._put(np.zeros((H * B,) + x.shape[1:], x.dtype), spec)
    return state._replace(acts=buffers(), cots=buffers(),
                          past_inputs=past(inputs), past_targets=past(targets))

  def _build_step(self, inputs):
    S, M = self.schedule.num_stages, self.schedule.num_microbatches
    B = self.schedule.num_minibatches
    C, W = self.program.num_slots, self.program.backward_width
    H, K = self.program.history, len(self.program.tables)
    boundary, buffer_shape, act_dtype = self._activation_layout(inputs)
    pp, op = self._param_packing, self._opt_packing
    extra_args = isinstance(self.optimizer, optax.GradientTransformationExtraArgs)

    def to_buffer(y):
      y = y.reshape(buffer_shape[0], -1).astype(act_dtype)
      return jnp.pad(y, ((0, 0), (0, buffer_shape[1] - y.shape[1])))

    def from_buffer(s, buf):
      """Stage s's input (s > 0), or stage s-1's output cotangent, from a row."""
      shape = boundary[s - 1]
      n = int(np.prod(shape.shape[1:]))
      return buf[:, :n].reshape(shape.shape).astype(shape.dtype)

    def ring_slot(versions, version):
      return jnp.argmax(versions == version)

    def stage_task(s, carry, instr, base, inputs, targets):
      """Stage s's task this tick; returns the carry and the two sends."""
      fn, last = self.stage_fns[s], s == S - 1
      mini, micro = instr[_COL["minibatch"]], instr[_COL["microbatch"]]
      slot = (instr[_COL["slot"]] + base) % C
      version = carry["latest"] - instr[_COL["lag"]]
      # Read inside the branches that use them: an idle tick reads nothing.
      weights = lambda: pp.unpack(s, {k: v[ring_slot(carry["versions"], version)]
                                      for k, v in carry["ring"].items()})
      no_send_f = jnp.zeros(buffer_shape, act_dtype)
      no_send_b = jnp.zeros((W,) + buffer_shape, act_dtype)

      def stage_input(w):
        if s == 0:
          return inputs[mini, micro + w]
        return from_buffer(s, carry["acts"][(slot + w) % C])

      def idle():
        return carry, no_send_f, no_send_b

      def forward():
        p = weights()
        y = fn(p, stage_input(0))
        if not last:
          return carry, to_buffer(y), no_send_b
        loss = self.loss_fn(y, targets[mini, micro])
        return (dict(carry, loss_sum=carry["loss_sum"] + loss,
                     num_losses=carry["num_losses"] + 1),
                no_send_f, no_send_b)

      def backward(fused):
        p = weights()
        g_sum, sends, loss = None, [], jnp.zeros((), jnp.float32)
        for w in range(W):
          x = stage_input(w)
          if last:
            objective = lambda p, x: self.loss_fn(  # pylint: disable=cell-var-from-loop
                fn(p, x), targets[mini, micro + w]) / M
            if s == 0:  # x may be integer (token ids): no cotangent to send
              value, g = jax.value_and_grad(objective)(p, x)
              g = (g, None)
            else:
              value, g = jax.value_and_grad(objective, (0, 1))(p, x)
            loss = loss + value * M
          else:
            _, vjp = jax.vjp(fn, p, x)
            g = vjp(from_buffer(s + 1, carry["cots"][(slot + w) % C]))
          g_sum = g[0] if g_sum is None else jax.tree.map(jnp.add, g_sum, g[0])
          sends.append(to_buffer(g[1]) if s > 0 else no_send_f)
        g_flat = pp.pack(s, g_sum)
        new = dict(carry, grads={k: carry["grads"][k] + g_flat[k]
                                 for k in g_flat})
        if fused:
          new["loss_sum"] = carry["loss_sum"] + loss
          new["num_losses"] = carry["num_losses"] + W
        return new, no_send_f, jnp.stack(sends)

      return jax.lax.switch(
          instr[_COL["kind"]],
          [idle, forward, functools.partial(backward, False),
           functools.partial(backward, True)])

    def stage_update(s, ring, versions, latest, opt_state, grads, instr):
      current = {k: v[ring_slot(versions, latest)] for k, v in ring.items()}
      p, o, g = pp.unpack(s, current), op.unpack(s, opt_state), pp.unpack(s, grads)
      if extra_args:
        stale = {k: v[ring_slot(versions, latest - instr[_COL["update_lag"]])]
                 for k, v in ring.items()}
        updates, o = self.optimizer.update(g, o, p,
                                           stale_params=pp.unpack(s, stale))
      else:
        updates, o = self.optimizer.update(g, o, p)
      return pp.pack(s, optax.apply_updates(p, updates)), op.pack(s, o)

    floats = [k for k in pp.lengths if jnp.issubdtype(jnp.dtype(k), jnp.floating)]
    wave, Q = self.sync.wave, self.sync.clock_distance + 1
    can_mix = type(self.sync).mixing is not sync_lib.SyncPolicy.mixing

    def wave_sync(waves, params, current, minibatch, delay):
      """WSP (sync/wsp.py): accumulate this wave's own updates; at its end,
      push them (one collective) and add the global updates now due."""
      acc = {k: waves["acc"][k] + params[k] - current[k] for k in floats}

      def end_of_wave():
        c = minibatch // wave
        others = {k: jax.lax.pmean(acc[k], DATA) - acc[k] for k in floats}
        slot = c % Q
        pending = {k: waves["pending"][k].at[slot].set(others[k])
                   for k in floats}
        tags = waves["pending_wave"].at[slot].set(c)
        due = (tags >= 0) & (tags <= c - delay)
        new = dict(params)
        for k in floats:
          new[k] = params[k] + jnp.einsum("q,ql->l", due.astype(params[k].dtype),
                                          pending[k])
        return (new, {"acc": {k: jnp.zeros_like(v) for k, v in acc.items()},
                      "pending": pending,
                      "pending_wave": jnp.where(due, -1, tags)})

      return jax.lax.cond(
          (minibatch + 1) % wave == 0, end_of_wave,
          lambda: (params, dict(waves, acc=acc)))

    def mix(params, weights):
      """SDPipe eq. 1: x <- sum_d W[me, d] x_d over the 'data' axis."""
      return {k: jnp.einsum("d,dl->l", weights.astype(v.dtype),
                            jax.lax.all_gather(v, DATA)) if k in floats else v
              for k, v in params.items()}

    def body(ring, versions, latest, opt_state, grads, acts, cots, waves,
             past_inputs, past_targets, inputs, targets, tables, step, plan):
      local = lambda tree: jax.tree.map(lambda v: v[0, 0], tree)
      window_inputs = jnp.concatenate([past_inputs, inputs])
      window_targets = jnp.concatenate([past_targets, targets])
      stage = jax.lax.axis_index(STAGE)
      replica = jax.lax.axis_index(DATA)
      base = (step % C) * (B * M % C) % C
      table = jax.lax.dynamic_index_in_dim(tables, jnp.minimum(step, K - 1),
                                           keepdims=False)
      branches = [functools.partial(stage_task, s) for s in range(S)]
      updates = [functools.partial(stage_update, s) for s in range(S)]

      def update(carry, instr):
        ring, versions, latest = (carry["ring"], carry["versions"],
                                  carry["latest"])
        grads = carry["grads"]
        if self.sync.average_gradients:
          grads = jax.lax.pmean(grads, DATA)
        params, opt_state = jax.lax.switch(stage, updates, ring, versions,
                                           latest, carry["opt_state"], grads,
                                           instr)
        rel = instr[_COL["update_minibatch"]]
        waves = carry["waves"]
        if wave:
          current = {k: v[ring_slot(versions, latest)] for k, v in ring.items()}
          minibatch = (step - H) * B + rel
          params, waves = wave_sync(waves, params, current, minibatch,
                                    plan["delay"][rel, replica])
        if can_mix:
          params = jax.lax.cond(plan["mix_on"][rel, stage] == 1, mix,
                                lambda x, _: x, params,
                                plan["mix"][rel, stage, replica])
        evict = instr[_COL["evict"]]
        write = jnp.where(evict >= 0, ring_slot(versions, latest - evict),
                          ring_slot(versions, -1))
        return dict(
            carry, ring={k: v.at[write].set(params[k]) for k, v in ring.items()},
            versions=versions.at[write].set(latest + 1), latest=latest + 1,
            opt_state=opt_state, waves=waves,
            grads=jax.tree.map(jnp.zeros_like, grads))

      def tick(carry, rows):
        instr = rows[stage]
        carry, send_f, send_b = jax.lax.switch(
            stage, branches, carry, instr, base, window_inputs, window_targets)
        recv_f = jax.lax.ppermute(send_f, STAGE,
                                  [(s, s + 1) for s in range(S - 1)])
        recv_b = jax.lax.ppermute(send_b, STAGE,
                                  [(s + 1, s) for s in range(S - 1)])
        at_f, at_b = instr[_COL["recv_forward"]], instr[_COL["recv_backward"]]
        acts, cots = carry["acts"], carry["cots"]
        acts = jax.lax.cond(at_f >= 0,
                            lambda: acts.at[(at_f + base) % C].set(recv_f),
                            lambda: acts)

        def file_cotangents():
          out = cots
          for w in range(W):
            out = out.at[(at_b + base + w) % C].set(recv_b[w])
          return out

        cots = jax.lax.cond(at_b >= 0, file_cotangents, lambda: cots)
        carry = dict(carry, acts=acts, cots=cots)
        carry = jax.lax.cond(instr[_COL["update"]] == 1, update,
                             lambda c, _: c, carry, instr)
        return carry, None

      carry = dict(ring=local(ring), versions=local(versions),
                   latest=local(latest), opt_state=local(opt_state),
                   grads=local(grads), acts=local(acts), cots=local(cots),
                   waves=local(waves), loss_sum=jnp.zeros((), jnp.float32),
                   num_losses=jnp.zeros((), jnp.int32))
      carry, _ = jax.lax.scan(tick, carry, table)
      num_losses = jax.lax.psum(carry["num_losses"], STAGE)
      loss = jax.lax.pmean(jax.lax.psum(carry["loss_sum"], STAGE),
                           DATA) / jnp.where(num_losses > 0, num_losses, jnp.nan)
      expand = lambda tree: jax.tree.map(lambda v: v[None, None], tree)
      keep = window_inputs.shape[0] - H * B
      return (expand(carry["ring"]), expand(carry["versions"]),
              expand(carry["latest"]), expand(carry["opt_state"]),
              expand(carry["grads"]), expand(carry["acts"]),
              expand(carry["cots"]), expand(carry["waves"]),
              window_inputs[keep:], window_targets[keep:], loss, num_losses)

    local, window = P(DATA, STAGE), P(None, None, DATA)
    mapped = jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(local,) * 8 + (window,) * 4 + (P(), P(), P()),
        out_specs=(local,) * 8 + (window,) * 2 + (P(), P()), check_vma=False)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step_fn(state, inputs, targets, tables, plan):
      (ring, versions, latest, opt_state, grads, acts, cots, waves,
       past_inputs, past_targets, loss, num_losses) = mapped(
           state.params, state.versions, state.latest, state.opt_state,
           state.grads, state.acts, state.cots, state.waves, state.past_inputs,
           state.past_targets, inputs, targets, tables, state.step, plan)
      state = PipelineState(ring, versions, latest, opt_state, grads, acts,
                            cots, past_inputs, past_targets, waves,
                            state.step + 1)
      return state, {"loss": loss, "num_losses": num_losses}

    return step_fn
