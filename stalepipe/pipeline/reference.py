"""The sequential oracle: a schedule's tasks run one by one on one device.

Plain and obviously right, with nothing clever: every weight version ever made
is kept, every activation and cotangent sits in a dict keyed by (replica,
stage, minibatch, micro-batch), each task reads exactly the version the
schedule's version map names, and data replicas are explicit, each on its
own slice of every micro-batch. At each update the sync policy acts the way
`stalepipe.sync` describes it: BSP averages the replicas' gradients, WSP adds
each wave's mean update after the wave's delay, and group policies average the
new weights with their mixing matrix. The shard_map executor must reproduce
it.

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
from stalepipe.schedules import Schedule


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
  wave_updates: dict  # (replica, stage, wave) -> the replica's own update sum
  wave_added: frozenset  # (replica, stage, wave) whose global update is added
  inputs: dict  # minibatch -> [M, D * b, ...]
  targets: dict  # minibatch -> [M, D * b, ...]
  window: int


class Pipeline:
  """The oracle, with the executor's interface but no mesh.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`.
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters
      (a `GradientTransformationExtraArgs` also gets `stale_params=`).
    num_replicas: D, data replicas; each takes its own 1/D of a micro-batch.
    sync: the sync policy across replicas; default BSP.
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation,
               num_replicas: int = 1, sync: sync_lib.SyncPolicy | None = None):
    self.stage_fns = tuple(stage_fns)
    self.loss_fn = loss_fn
    self.schedule = schedule
    self.optimizer = optimizer
    self.num_replicas = num_replicas
    self.sync = sync or sync_lib.bsp(num_replicas)

  def init(self, stage_params: Sequence[Any]) -> ReferenceState:
    """Version 0 of every stage on every replica, and fresh optimizer states."""
    D = self.num_replicas
    return ReferenceState(
        versions={(d, s): (p,) for d in range(D)
                  for s, p in enumerate(stage_params)},
        provenance={(d, s): (frozenset(),) for d in range(D)
                    for s in range(len(stage_params))},
        opt_states={(d, s): self.optimizer.init(p) for d in range(D)
                    for s, p in enumerate(stage_params)},
        grads={}, acts={}, cots={}, wave_updates={}, wave_added=frozenset(),
        inputs={}, targets={}, window=0)

  def params(self, state: ReferenceState, replica: int = 0) -> tuple[Any, ...]:
    """The latest weights of the S stages on data replica `replica`."""
    return tuple(state.versions[(replica, s)][-1]
                 for s in range(len(self.stage_fns)))

  def step(self, state: ReferenceState, inputs, targets):
    """Runs window k: the ticks from the stage-0 forward of minibatch kB up to
    that of minibatch (k+1)B, in the schedule over an endless stream."""
    B, M, S = (self.schedule.num_minibatches, self.schedule.num_microbatches,
               self.schedule.num_stages)
    D, k = self.num_replicas, state.window
    stream = self.schedule.with_minibatches((k + 2) * B)
    first = {t.minibatch: t.tick for t in stream.tasks
             if t.stage == 0 and t.kind in ("F", "FB") and t.microbatch == 0}
    versions = {key: list(v) for key, v in state.versions.items()}
    provenance = {key: list(v) for key, v in state.provenance.items()}
    staleness = {}  # minibatch -> most updates a forward of it missed
    opt_states = dict(state.opt_states)
    grads, acts, cots = dict(state.grads), dict(state.acts), dict(state.cots)
    wave_updates, wave_added = dict(state.wave_updates), set(state.wave_added)
    all_inputs, all_targets = dict(state.inputs), dict(state.targets)
    for i in range(B):
      all_inputs[k * B + i] = jnp.asarray(inputs[i])
      all_targets[k * B + i] = jnp.asarray(targets[i])
    if np.shape(inputs)[2] % D:
      raise ValueError(f"inputs shape {np.shape(inputs)} is invalid; valid: "
                       f"[{B}, {M}, a multiple of {D} data replicas, ...]")
    n = np.shape(inputs)[2] // D
    part = lambda x, d: x[:, d * n:(d + 1) * n]
    losses = []
    updates_at = {}
    for (s, p), u in stream.update_ticks.items():
      updates_at.setdefault(u, []).append((s, p))

    def run_task(t, d):
      s, p = t.stage, t.minibatch
      fn, w = self.stage_fns[s], versions[(d, s)][stream.task_version(t)]
      x_of = lambda m: (part(all_inputs[p], d)[m] if s == 0
                        else acts[(d, s, p, m)])
      if t.kind in ("F", "FB"):
        seen = provenance[(d, s)][stream.task_version(t)]
        prefix = min(next(q for q in range(p + 1) if (e, q) not in seen)
                     for e in range(D))
        staleness[p] = max(staleness.get(p, 0), p - prefix)
      if t.kind == "F":
        y = fn(w, x_of(t.microbatch))
        if s + 1 < S:
          acts[(d, s + 1, p, t.microbatch)] = y
        else:
          losses.append(self.loss_fn(y, part(all_targets[p], d)[t.microbatch]))
        return
      micro = range(M) if stream.backward_covers_minibatch else (t.microbatch,)
      for m in micro:
        if s == S - 1:
          target = part(all_targets[p], d)[m]
          objective = lambda w, x: self.loss_fn(fn(w, x), target) / M  # pylint: disable=cell-var-from-loop
          if s == 0:  # x may be integer (token ids): no cotangent to send
            loss, gw = jax.value_and_grad(objective)(w, x_of(m))
          else:
            loss, (gw, gx) = jax.value_and_grad(objective, (0, 1))(w, x_of(m))
          if t.kind == "FB":
            losses.append(loss * M)
        else:
          _, vjp = jax.vjp(fn, w, x_of(m))
          gw, gx = vjp(cots.pop((d, s, p, m)))
        key = (d, s, p)
        grads[key] = (gw if key not in grads
                      else jax.tree.map(jnp.add, grads[key], gw))
        if s > 0:
          cots[(d, s - 1, p, m)] = gx

    def run_update(s, p):
      kind = "FB" if any(t.kind == "FB" and t.stage == s
                         for t in stream.tasks) else "B"
      stale_version = stream.version(p, s, kind, 0)  # its first backward's
      g = [grads.pop((d, s, p)) for d in range(D)]
      seen = [provenance[(d, s)][-1] | {(d, p)} for d in range(D)]
      if self.sync.average_gradients:
        mean = jax.tree.map(lambda *x: sum(x) / D, *g)
        g = [mean] * D
        seen = [x | {(e, p) for e in range(D)} for x in seen]
      new = []
      for d in range(D):
        current = versions[(d, s)][-1]
        kwargs = {}
        if isinstance(self.optimizer, optax.GradientTransformationExtraArgs):
          kwargs["stale_params"] = versions[(d, s)][stale_version]
        upd, opt_states[(d, s)] = self.optimizer.update(
            g[d], opt_states[(d, s)], current, **kwargs)
        new.append(optax.apply_updates(current, upd))
      if self.sync.wave:
        c = p // self.sync.wave
        for d in range(D):
          own = jax.tree.map(jnp.subtract, new[d], versions[(d, s)][-1])
          key = (d, s, c)
          wave_updates[key] = (own if key not in wave_updates else
                               jax.tree.map(jnp.add, wave_updates[key], own))
        if (p + 1) % self.sync.wave == 0:  # replica d pulls waves <= c - delay
          for d in range(D):
            for w in range(c + 1 - self.sync.wave_delay(c)[d]):
              if (d, s, w) in wave_added:
                continue
              wave_added.add((d, s, w))
              mean = jax.tree.map(lambda *x: sum(x) / D,
                                  *[wave_updates[(e, s, w)] for e in range(D)])
              new[d] = jax.tree.map(lambda a, m, o: a + m - o, new[d], mean,
                                    wave_updates[(d, s, w)])
              seen[d] = seen[d] | {
                  (e, q) for e in range(D)
                  for q in range(w * self.sync.wave, (w + 1) * self.sync.wave)}
      mixing = self.sync.mixing(s, p)
      if mixing is not None:
        new = [jax.tree.map(lambda *x: sum(mixing[d, e] * x[e]  # pylint: disable=cell-var-from-loop
                                           for e in range(D)), *new)
               for d in range(D)]
        seen = [frozenset().union(*[seen[e] for e in range(D) if mixing[d, e]])
                for d in range(D)]
      for d in range(D):
        versions[(d, s)].append(new[d])
        provenance[(d, s)].append(frozenset(seen[d]))

    for tick in range(first[k * B], first[(k + 1) * B]):
      for t in (t for t in stream.tasks if t.tick == tick):
        for d in range(D):
          run_task(t, d)
      for s, p in updates_at.get(tick, ()):
        run_update(s, p)

    state = ReferenceState(
        versions={key: tuple(v) for key, v in versions.items()},
        provenance={key: tuple(v) for key, v in provenance.items()},
        opt_states=opt_states, grads=grads, acts=acts, cots=cots,
        wave_updates=wave_updates, wave_added=frozenset(wave_added),
        inputs=all_inputs, targets=all_targets,
        window=k + 1)
    loss = jnp.mean(jnp.stack(losses)) if losses else jnp.nan
    return state, {"loss": loss, "num_losses": len(losses) // D,
                   "staleness": staleness}
