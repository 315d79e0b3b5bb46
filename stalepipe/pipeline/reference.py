"""The sequential oracle: a schedule's tasks run one by one on one device.

Plain and obviously right, with nothing clever: every weight version ever made
is kept, every activation and cotangent sits in a dict keyed by (replica,
stage, minibatch, micro-batch), each task reads exactly the version the
schedule's version map names, and data replicas are explicit, each on its
own slice of every micro-batch. Each task does what its kind declares
(`stalepipe.schedules.kinds`). At each update the optimizer gets the extra
arguments of the update-rule contract (`contract.py`), and the sync policy's
own functions act across the replicas (`reduce_gradient` before,
`after_update` after), run under `jax.vmap` over the explicit replicas with
the axis name the executor's mesh uses. The shard_map executor must
reproduce it.

The oracle also tracks which updates each weight version reflects, so it
reports every minibatch's *observed staleness*: `p - r`, with `r` the longest
prefix of minibatches whose updates from every replica the weights its
forward read reflect (HetPipe's measure: seed 001 §5).
"""

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stalepipe import sync as sync_lib
from stalepipe.pipeline import contract
from stalepipe.pipeline import scope as scope_lib
from stalepipe.pipeline import stage as stage_lib
from stalepipe.schedules import Schedule
from stalepipe.schedules import kinds as kinds_lib

_AXIS = "data"


def _stack(trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def _first_forwards(stream) -> dict[int, int]:
  """Minibatch -> the tick of its first stage-0 forward."""
  return {t.minibatch: t.tick for t in stream.tasks
          if t.stage == 0 and stream.kind(t).runs_forward
          and t.microbatch == 0}


def _item(tree, m):
  return jax.tree.map(lambda v: v[m], tree)


def _unstack(tree, num):
  return [jax.tree.map(lambda x: x[d], tree) for d in range(num)]  # pylint: disable=cell-var-from-loop


@dataclasses.dataclass(frozen=True)
class ReferenceState:
  """Everything the oracle carries between windows."""

  versions: dict  # (replica, stage) -> list of every weight version
  provenance: dict  # (replica, stage) -> per version, the (replica,
  #   minibatch) updates it reflects (wholly, or in part through averaging)
  opt_states: dict  # (replica, stage) -> optimizer state
  grads: dict  # (replica, stage, minibatch) -> accumulated gradient
  acts: dict  # (replica, stage, minibatch, micro-batch) -> the stage's input
  cots: dict  # (replica, stage, minibatch, micro-batch) -> output cotangent
  sync_states: dict  # stage -> the sync policy's state, stacked over replicas
  inputs: dict  # minibatch -> [M, D * b, ...]
  targets: dict  # minibatch -> [M, D * b, ...]
  window: int
  states: dict = dataclasses.field(default_factory=dict)  # (replica, stage)
  #   -> the stage's non-parameter state, for stages that take one
  drained: bool = False  # `drain` ran: no further step or drain


class Pipeline:
  """The oracle, with the executor's interface but no mesh.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`.
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters
      (with the extra arguments and `predict` of `contract.py`).
    num_replicas: D, data replicas; each takes its own 1/D of a micro-batch.
    sync: the sync policy across replicas; default BSP.
    optimizer_scope: "model", "stage" or "auto", as the executor's
      (`scope.py`).
    seed: whence the PRNG key of each task, as the executor's (`stage.py`).
    tied: parameters several stages hold, as the executor's.
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation,
               num_replicas: int = 1, sync: sync_lib.SyncPolicy | None = None,
               optimizer_scope: str = "auto", seed: int = 0,
               tied: Sequence[str] = ()):
    sync = sync or sync_lib.bsp(num_replicas)
    contract.check(stage_fns, schedule, optimizer, sync, num_replicas)
    self.tied = frozenset(tied)
    self.optimizer_scope = scope_lib.resolve(optimizer_scope, optimizer,
                                             schedule, self.tied)
    if self.optimizer_scope == "model":
      schedule = schedule.together()
    self.stage_fns = tuple(stage_fns)
    self.seed = seed
    self._fns, self._state_fns, self._wants = stage_lib.bind_all(stage_fns)
    self._checked = set()  # stages whose state use `stage.check_state` saw
    self.loss_fn = loss_fn
    self._loss_fn = stage_lib.bind_loss(loss_fn)
    self.schedule = schedule
    self.optimizer = optimizer
    self.num_replicas = num_replicas
    self.sync = sync
    self._stale_schedule = contract.schedule_is_stale(schedule)
    # The policy's own functions, over the explicit replicas as one axis
    # (jitted once: the minibatch and stage are traced, not baked in).
    self._reduce_gradient = jax.jit(jax.vmap(
        lambda g: sync.reduce_gradient(g, _AXIS), axis_name=_AXIS))
    self._after_update = jax.jit(jax.vmap(
        lambda x, y, state, r, event: sync.after_update(
            x, y, state, event._replace(replica=r), _AXIS),
        in_axes=(0, 0, 0, 0, None), axis_name=_AXIS))

  def init(self, stage_params: Sequence[Any],
           stage_states: Sequence[Any] | None = None) -> ReferenceState:
    """Version 0 of every stage on every replica, fresh optimizer states, and
    the stages' initial states where they take one (`stage.py`)."""
    D = self.num_replicas
    states = stage_lib.initial_states(self._wants, stage_states) or ()
    opt_states = scope_lib.init_states(self.optimizer, self.optimizer_scope,
                                       stage_params, self.tied)
    return ReferenceState(
        versions={(d, s): (p,) for d in range(D)
                  for s, p in enumerate(stage_params)},
        provenance={(d, s): (frozenset(),) for d in range(D)
                    for s in range(len(stage_params))},
        opt_states={(d, s): opt_states[s] for d in range(D)
                    for s in range(len(stage_params))},
        grads={}, acts={}, cots={},
        sync_states={s: jax.vmap(self.sync.init_state)(_stack([p] * D))
                     for s, p in enumerate(stage_params)},
        inputs={}, targets={}, window=0,
        states={(d, s): v for d in range(D) for s, v in enumerate(states)
                if self._state_fns[s] is not None})

  def params(self, state: ReferenceState, replica: int = 0) -> tuple[Any, ...]:
    """The latest weights of the S stages on data replica `replica`."""
    return tuple(state.versions[(replica, s)][-1]
                 for s in range(len(self.stage_fns)))

  def stage_states(self, state: ReferenceState,
                   replica: int = 0) -> tuple[Any, ...] | None:
    """The S stages' states on data replica `replica` (None for a stage
    without; None if no stage has one)."""
    if not state.states:
      return None
    return tuple(state.states.get((replica, s))
                 for s in range(len(self.stage_fns)))

  def _check_window(self, inputs, targets) -> None:
    B, M = self.schedule.num_minibatches, self.schedule.num_microbatches
    D = self.num_replicas
    for shape in [np.shape(v) for v in jax.tree.leaves((inputs, targets))]:
      if len(shape) < 3 or shape[:2] != (B, M) or shape[2] % D:
        raise ValueError(f"inputs shape {shape} is invalid; valid: "
                         f"[{B}, {M}, a multiple of {D} data replicas, ...]")

  def evaluate(self, state: ReferenceState, inputs, targets) -> dict:
    """Forward only, as the executor's `evaluate`: every micro-batch of the
    window through every replica's latest weights (and states) with
    `train=False`, its key that of window minibatch p (0..B-1); nothing
    changes.

    Returns:
      `loss` (the mean of `loss_fn`, no auxiliary terms), the mean of every
      metric, over the micro-batches and replicas, and `outputs`, the last
      stage's outputs `[B, M, D * b, ...]`.
    """
    self._check_window(inputs, targets)
    B, M, D = (self.schedule.num_minibatches, self.schedule.num_microbatches,
               self.num_replicas)
    n = np.shape(jax.tree.leaves(inputs)[0])[2] // D
    fns = [stage_lib.bind(f, train=False, first=s == 0)
           for s, f in enumerate(self.stage_fns)]
    objectives, outputs = [], []
    for p in range(B):
      for m in range(M):
        for d in range(D):
          part = lambda tree: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment,cell-var-from-loop
              lambda v: jnp.asarray(v[p, m, d * n:(d + 1) * n]), tree)  # pylint: disable=cell-var-from-loop
          y = part(inputs)
          for s, fn in enumerate(fns):
            y = fn(state.versions[(d, s)][-1], stage_lib.with_extras(
                y, self._wants[s], self.seed, p, m, s, d,
                state.states.get((d, s))))
          objectives.append(stage_lib.evaluation_objective(
              self.loss_fn, y, part(targets)))
          outputs.append(y[0])
    loss, metrics = jax.tree.map(lambda *v: jnp.mean(jnp.stack(v)),
                                 *objectives)
    return {"loss": loss, **metrics, "outputs": jax.tree.map(
        lambda *v: jnp.concatenate(v).reshape((B, M, D * n) + v[0].shape[1:]),
        *outputs)}

  def step(self, state: ReferenceState, inputs, targets):
    """Runs window k: the ticks from the stage-0 forward of minibatch kB up to
    that of minibatch (k+1)B, in the schedule over an endless stream."""
    contract.refuse_drained(state.drained)
    self._check_window(inputs, targets)
    B, D, k = self.schedule.num_minibatches, self.num_replicas, state.window
    stream = self.schedule.with_minibatches((k + 2) * B)
    w = self._scratch(state, stream, np.shape(jax.tree.leaves(inputs)[0])[2]
                      // D)
    for i in range(B):
      w.inputs[k * B + i] = jax.tree.map(lambda v: jnp.asarray(v[i]), inputs)  # pylint: disable=cell-var-from-loop
      w.targets[k * B + i] = jax.tree.map(lambda v: jnp.asarray(v[i]),  # pylint: disable=cell-var-from-loop
                                          targets)
    first = _first_forwards(stream)
    self._run_ticks(w, range(first[k * B], first[(k + 1) * B]))
    return self._finish(w, k + 1)

  def drain(self, state: ReferenceState):
    """Finishes the minibatches still in flight after the last window (an
    asynchronous schedule's): every remaining task and update of
    minibatches before kB runs, none of later ones. The state is then for
    `params` and `evaluate`; `step` and `drain` refuse it."""
    contract.refuse_drained(state.drained)
    k, B = state.window, self.schedule.num_minibatches
    if not state.inputs:
      return dataclasses.replace(state, drained=True), {
          "loss": jnp.nan, "num_losses": 0, "staleness": {}}
    stream = self.schedule.with_minibatches((k + 2) * B)
    some = jax.tree.leaves(next(iter(state.inputs.values())))[0]
    w = self._scratch(state, stream, np.shape(some)[1] // self.num_replicas)
    self._run_ticks(w, range(_first_forwards(stream)[k * B],
                             stream.num_ticks), below=k * B)
    state, metrics = self._finish(w, k)
    return dataclasses.replace(state, drained=True), metrics

  def _scratch(self, state: ReferenceState, stream, n: int) -> "_Scratch":
    return _Scratch(
        stream=stream,
        versions={key: list(v) for key, v in state.versions.items()},
        provenance={key: list(v) for key, v in state.provenance.items()},
        opt_states=dict(state.opt_states), grads=dict(state.grads),
        acts=dict(state.acts), cots=dict(state.cots),
        sync_states=dict(state.sync_states), inputs=dict(state.inputs),
        targets=dict(state.targets), n=n, states=dict(state.states))

  def _run_ticks(self, w: "_Scratch", ticks, below: int | None = None):
    """Every task and update in `ticks` (of minibatches before `below`)."""
    keep = lambda p: below is None or p < below  # pylint: disable=unnecessary-lambda-assignment
    updates_at = {}
    for (s, p), u in sorted(w.stream.update_ticks.items()):
      if keep(p):
        updates_at.setdefault(u, []).append((s, p))
    for tick in ticks:
      for t in (t for t in w.stream.tasks if t.tick == tick
                and keep(t.minibatch)):
        for d in range(self.num_replicas):
          self._run_task(w, t, d)
      due = updates_at.get(tick, ())
      if self.optimizer_scope == "model":
        for p in sorted({p for _, p in due}):
          self._run_update(w, p)
      else:
        for s, p in due:
          self._run_update(w, p, (s,))

  def _finish(self, w: "_Scratch", window: int):
    state = ReferenceState(
        versions={key: tuple(v) for key, v in w.versions.items()},
        provenance={key: tuple(v) for key, v in w.provenance.items()},
        opt_states=w.opt_states, grads=w.grads, acts=w.acts, cots=w.cots,
        sync_states=w.sync_states, inputs=w.inputs, targets=w.targets,
        window=window, states=w.states)
    loss = jnp.mean(jnp.stack(w.losses)) if w.losses else jnp.nan
    metrics = (jax.tree.map(lambda *v: jnp.mean(jnp.stack(v)), *w.metrics)
               if w.metrics else {})
    return state, {"loss": loss, "num_losses": len(w.losses)
                   // self.num_replicas, "staleness": w.staleness, **metrics}

  def _weights(self, w: "_Scratch", t, d: int):
    """The weights task t reads on replica d: its version, or as predicted."""
    weights = w.versions[(d, t.stage)][w.stream.task_version(t)]
    if not contract.predicts(self.optimizer):
      return weights
    counts = {"ahead": w.stream.ahead(t),
              "since_forward": w.stream.since_forward(t)}
    if contract.pipeline_wide(self.optimizer):
      counts["pipeline_ahead"] = w.stream.pipeline_ahead(t)
    return self.optimizer.predict(w.opt_states[(d, t.stage)], weights,
                                  **counts)

  def _observe(self, w: "_Scratch", t, d: int) -> None:
    """HetPipe's observed staleness of t's minibatch, from what its forward
    read: p minus the longest prefix every replica's updates reach."""
    p = t.minibatch
    seen = w.provenance[(d, t.stage)][w.stream.task_version(t)]
    prefix = min(next(q for q in range(p + 1) if (e, q) not in seen)
                 for e in range(self.num_replicas))
    w.staleness[p] = max(w.staleness.get(p, 0), p - prefix)

  def _run_task(self, w: "_Scratch", t, d: int) -> None:
    """Task t on replica d, as its kind declares."""
    s, p, kind = t.stage, t.minibatch, w.stream.kind(t)
    last, M = s == len(self.stage_fns) - 1, self.schedule.num_microbatches
    fn, weights = self._fns[s], self._weights(w, t, d)
    if kind.runs_forward:
      self._observe(w, t, d)
    for m in w.stream.covered_microbatches(t):
      x = stage_lib.with_extras(
          _item(w.part(w.inputs[p], d), m) if s == 0
          else w.acts[(d, s, p, m)], self._wants[s], self.seed, p, m, s, d,
          w.states.get((d, s)))
      target = _item(w.part(w.targets[p], d), m)
      if kind.runs_forward and self._state_fns[s] is not None:
        if s not in self._checked:
          stage_lib.check_state(fn, self._state_fns[s], weights, x, s)
          self._checked.add(s)
        w.states[(d, s)] = self._state_fns[s](weights, x)
      if not kind.runs_backward:
        y = fn(weights, x)
        if last:
          loss, metrics = self._loss_fn(y, target)
          w.losses.append(loss)
          w.metrics.append(metrics)
        else:
          w.acts[(d, s + 1, p, m)] = y
        continue
      if last:
        def objective(v, x):
          loss, metrics = self._loss_fn(fn(v, x), target)  # pylint: disable=cell-var-from-loop
          return loss / M, metrics
        # Integer leaves of x (token ids) get a float0 cotangent.
        (loss, metrics), (gw, gx) = jax.value_and_grad(
            objective, (0, 1), has_aux=True, allow_int=True)(weights, x)
        if kind.runs_forward:
          w.losses.append(loss * M)
          w.metrics.append(metrics)
      else:
        _, vjp = jax.vjp(fn, weights, x)
        gw, gx = vjp(w.cots[(d, s, p, m)])
      key = (d, s, p)
      if kinds_lib.WEIGHT_GRADIENT in kind.produces:
        w.grads[key] = (gw if key not in w.grads
                        else jax.tree.map(jnp.add, w.grads[key], gw))
      if s > 0 and kinds_lib.INPUT_COTANGENT in kind.produces:
        w.cots[(d, s - 1, p, m)] = stage_lib.input_cotangent(
            gx, self._wants[s])

  def _run_update(self, w: "_Scratch", p: int,
                  stages: tuple[int, ...] | None = None) -> None:
    """Minibatch p's update of `stages` on every replica, the sync policy's
    functions around it (under `jax.vmap` over the replicas). With `stages`
    None (optimizer_scope "model") the update rule steps once on the whole
    model's tree (`scope.join`); else on stage `stages[0]`'s tree alone."""
    D, stream = self.num_replicas, w.stream
    whole = stages is None
    stages = tuple(range(len(self.stage_fns))) if whole else stages
    own, g = {}, {}
    for s in stages:
      grads = [w.grads.pop((d, s, p)) for d in range(D)]
      reduced = _unstack(self._reduce_gradient(_stack(grads)), D)
      for d in range(D):
        own[(d, s)], g[(d, s)] = grads[d], reduced[d]
    current = {(d, s): w.versions[(d, s)][-1] for d in range(D) for s in stages}
    new = {}
    for d in range(D):
      # The whole model's tree: a tied leaf's gradients summed over its
      # stages, its weights (the same on each) taken once.
      tree = lambda f, add=False: (scope_lib.join(  # pylint: disable=unnecessary-lambda-assignment,cell-var-from-loop
          [f(s) for s in stages], self.tied, add) if whole else f(stages[0]))  # pylint: disable=cell-var-from-loop
      kwargs = contract.extra_args(
          self.optimizer, self._stale_schedule,
          stale_params=tree(lambda s: w.versions[(d, s)][  # pylint: disable=cell-var-from-loop
              stream.gradient_version(s, p)]),
          staleness=(stream.update_version(stages[0], p)
                     - stream.forward_version(stages[0], p)),
          local_updates=tree(lambda s: own[(d, s)], add=True))  # pylint: disable=cell-var-from-loop
      upd, opt_state = self.optimizer.update(
          tree(lambda s: g[(d, s)], add=True), w.opt_states[(d, stages[0])],  # pylint: disable=cell-var-from-loop
          tree(lambda s: current[(d, s)]), **kwargs)  # pylint: disable=cell-var-from-loop
      applied = optax.apply_updates(tree(lambda s: current[(d, s)]), upd)  # pylint: disable=cell-var-from-loop
      if whole:
        applied = scope_lib.parts(applied, [current[(d, s)] for s in stages],
                                  self.tied)
      for i, s in enumerate(stages):
        w.opt_states[(d, s)] = opt_state
        new[(d, s)] = applied[i] if whole else applied
    for s in stages:
      plan = {k: jnp.asarray(v[0])
              for k, v in self.sync.plan(p, 1, len(self.stage_fns)).items()}
      versions, w.sync_states[s] = self._after_update(
          _stack([new[(d, s)] for d in range(D)]),
          _stack([current[(d, s)] for d in range(D)]), w.sync_states[s],
          jnp.arange(D), sync_lib.UpdateEvent(p, s, None, plan))
      seen = self._provenance(w, s, p)
      for d, x in enumerate(_unstack(versions, D)):
        w.versions[(d, s)].append(x)
        w.provenance[(d, s)].append(frozenset(seen[d]))

  def _provenance(self, w: "_Scratch", s: int, p: int) -> list[set]:
    """Per replica, the (replica, minibatch) updates stage s's new version
    reflects, wholly or in part (through averaging or a wave's pull)."""
    D = self.num_replicas
    seen = [w.provenance[(d, s)][-1] | {(d, p)} for d in range(D)]
    if self.sync.average_gradients:
      seen = [x | {(e, p) for e in range(D)} for x in seen]
    if self.sync.wave and (p + 1) % self.sync.wave == 0:
      c = p // self.sync.wave
      for d in range(D):  # replica d now has the waves up to c - delay
        pulled = (c - self.sync.wave_delay(c)[d] + 1) * self.sync.wave
        seen[d] = seen[d] | {(e, q) for e in range(D) for q in range(pulled)}
    mixing = self.sync.mixing(s, p)
    if mixing is not None:
      seen = [frozenset().union(*[seen[e] for e in range(D) if mixing[d, e]])
              for d in range(D)]
    return seen


@dataclasses.dataclass
class _Scratch:
  """One window's working copies of the oracle's state (mutable)."""

  stream: Schedule
  versions: dict
  provenance: dict
  opt_states: dict
  grads: dict
  acts: dict
  cots: dict
  sync_states: dict
  inputs: dict
  targets: dict
  n: int  # examples of a micro-batch per replica
  states: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  metrics: list = dataclasses.field(default_factory=list)  # per loss
  staleness: dict = dataclasses.field(default_factory=dict)  # minibatch ->
  #   most updates a forward of it missed

  def part(self, x, d: int):
    """Replica d's slice of every micro-batch of `x` ([M, D * n, ...] each
    leaf)."""
    return jax.tree.map(lambda v: v[:, d * self.n:(d + 1) * self.n], x)
