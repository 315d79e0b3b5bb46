"""The sequential oracle: a schedule's tasks run one by one on one device.

Plain and obviously right, with nothing clever: every weight version ever made
is kept, every activation and cotangent sits in a dict keyed by (stage,
minibatch, micro-batch), and each task reads exactly the version the
schedule's version map names. The shard_map executor must reproduce it.

Data replicas are not modelled: a micro-batch is the whole `[D * b, ...]`
slice, which under all-reduce gives the replicas' common result.
"""

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from stalepipe.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class ReferenceState:
  """Everything the oracle carries between windows."""

  versions: tuple[tuple[Any, ...], ...]  # per stage, every weight version
  opt_states: tuple[Any, ...]  # per stage
  grads: dict  # (stage, minibatch) -> accumulated gradient
  acts: dict  # (stage, minibatch, micro-batch) -> the stage's input
  cots: dict  # (stage, minibatch, micro-batch) -> cotangent of its output
  inputs: dict  # minibatch -> [M, n, ...]
  targets: dict  # minibatch -> [M, n, ...]
  window: int


class Pipeline:
  """The oracle, with the executor's interface but no mesh.

  Args:
    stage_fns: S callables `f_s(params_s, x) -> y`.
    loss_fn: `loss_fn(y, target) -> scalar`, the mean over a micro-batch.
    schedule: the schedule of one window (its B minibatches).
    optimizer: an optax transformation, applied to each stage's parameters
      (a `GradientTransformationExtraArgs` also gets `stale_params=`).
  """

  def __init__(self, stage_fns: Sequence[Callable], loss_fn: Callable,
               schedule: Schedule, optimizer: optax.GradientTransformation):
    self.stage_fns = tuple(stage_fns)
    self.loss_fn = loss_fn
    self.schedule = schedule
    self.optimizer = optimizer

  def init(self, stage_params: Sequence[Any]) -> ReferenceState:
    return ReferenceState(
        versions=tuple((p,) for p in stage_params),
        opt_states=tuple(self.optimizer.init(p) for p in stage_params),
        grads={}, acts={}, cots={}, inputs={}, targets={}, window=0)

  def params(self, state: ReferenceState) -> tuple[Any, ...]:
    return tuple(v[-1] for v in state.versions)

  def step(self, state: ReferenceState, inputs, targets):
    """Runs window k: the ticks from the stage-0 forward of minibatch kB up to
    that of minibatch (k+1)B, in the schedule over an endless stream."""
    B, M, S = (self.schedule.num_minibatches, self.schedule.num_microbatches,
               self.schedule.num_stages)
    k = state.window
    stream = self.schedule.with_minibatches((k + 2) * B)
    first = {t.minibatch: t.tick for t in stream.tasks
             if t.stage == 0 and t.kind in ("F", "FB") and t.microbatch == 0}
    begin, end = first[k * B], first[(k + 1) * B]
    versions = [list(v) for v in state.versions]
    opt_states = list(state.opt_states)
    grads, acts, cots = dict(state.grads), dict(state.acts), dict(state.cots)
    all_inputs, all_targets = dict(state.inputs), dict(state.targets)
    for i in range(B):
      all_inputs[k * B + i] = jnp.asarray(inputs[i])
      all_targets[k * B + i] = jnp.asarray(targets[i])
    losses = []
    updates_at = {}
    for (s, p), u in stream.update_ticks.items():
      updates_at.setdefault(u, []).append((s, p))

    for tick in range(begin, end):
      for t in (t for t in stream.tasks if t.tick == tick):
        s, p = t.stage, t.minibatch
        fn, w = self.stage_fns[s], versions[s][stream.task_version(t)]
        x_of = lambda m: all_inputs[p][m] if s == 0 else acts[(s, p, m)]  # pylint: disable=cell-var-from-loop
        if t.kind == "F":
          y = fn(w, x_of(t.microbatch))
          if s + 1 < S:
            acts[(s + 1, p, t.microbatch)] = y
          else:
            losses.append(self.loss_fn(y, all_targets[p][t.microbatch]))
          continue
        micro = (range(M) if stream.backward_covers_minibatch
                 else (t.microbatch,))
        for m in micro:
          if s == S - 1:
            target = all_targets[p][m]
            loss, (gw, gx) = jax.value_and_grad(
                lambda w, x: self.loss_fn(fn(w, x), target) / M,  # pylint: disable=cell-var-from-loop
                (0, 1))(w, x_of(m))
            if t.kind == "FB":
              losses.append(loss * M)
          else:
            _, vjp = jax.vjp(fn, w, x_of(m))
            gw, gx = vjp(cots.pop((s, p, m)))
          grads[(s, p)] = (gw if (s, p) not in grads
                           else jax.tree.map(jnp.add, grads[(s, p)], gw))
          if s > 0:
            cots[(s - 1, p, m)] = gx
      for s, p in updates_at.get(tick, ()):
        kind = "FB" if any(t.kind == "FB" and t.stage == s
                           for t in stream.tasks) else "B"
        stale = versions[s][stream.version(p, s, kind, 0)]  # first backward
        current = versions[s][-1]
        if isinstance(self.optimizer, optax.GradientTransformationExtraArgs):
          upd, opt_states[s] = self.optimizer.update(
              grads.pop((s, p)), opt_states[s], current, stale_params=stale)
        else:
          upd, opt_states[s] = self.optimizer.update(
              grads.pop((s, p)), opt_states[s], current)
        versions[s].append(optax.apply_updates(current, upd))

    state = ReferenceState(
        versions=tuple(tuple(v) for v in versions),
        opt_states=tuple(opt_states), grads=grads, acts=acts, cots=cots,
        inputs=all_inputs, targets=all_targets, window=k + 1)
    loss = jnp.mean(jnp.stack(losses)) if losses else jnp.nan
    return state, {"loss": loss, "num_losses": len(losses)}
