"""Whether an update rule sees one stage or the whole model.

A pipeline holds each stage's weights on its own device and, by default,
steps the optimizer on each stage's tree alone. For an elementwise rule
(SGD, Adam, diagonal delay compensation) that is the same as stepping it on
the whole model. A rule that reduces over the whole tree is not:
`optax.clip_by_global_norm` would clip each stage by its own norm, full delay
compensation would take `<g, dx>` per stage. A user who writes such a chain
means the whole model, so the executors never run it per stage unasked:

- `optimizer_scope="model"`: at each minibatch's update every stage applies
  it at one tick (`Schedule.together`), after the last stage's gradient of
  it is finished; the update rule runs on the tuple of all stages' trees
  (the gradient, weights and optimizer state gathered across 'stage') and
  equals unpipelined training. Schedules where a stage reads a minibatch's
  update before another stage has finished its gradient (asynchronous
  PipeDream) cannot, and are refused.
- `optimizer_scope="stage"`: each stage's own update, on its own tree (per-
  stage norms); the explicit choice for a coupling rule on an asynchronous
  schedule.
- `optimizer_scope="auto"` (default): "model" if the rule couples stages
  (`couples_stages`), else "stage" (the two are then the same numbers).
"""

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.pipeline import contract
from stalepipe.pipeline import program

SCOPES = ("auto", "model", "stage")
_SCALES = (1e-4, 1.0, 1e4)  # gradient sizes the stand-in steps at
_SEEN = {}  # id(optimizer) -> (optimizer, whether it couples stages)


def _stand_in(seed: int):
  """Two small stage trees of random values."""
  rng = np.random.default_rng(seed)
  return tuple({"a": rng.normal(size=(3,)).astype(np.float32),
                "b": rng.normal(size=(2, 2)).astype(np.float32) + s}
               for s in range(2))


def _updates(optimizer, params, grads, stale) -> list:
  """Two steps' updates of `optimizer` on one tree (its own state)."""
  state, out = optimizer.init(params), []
  for g in grads:
    kwargs = contract.extra_args(optimizer, True, stale_params=stale,
                                 staleness=jnp.int32(1), local_updates=g)
    u, state = optimizer.update(g, state, params, **kwargs)
    out.append(u)
  return out


def couples_stages(optimizer) -> bool:
  """Whether `optimizer` on two stage trees together differs from it on each
  alone: on a stand-in model of two stages, two steps at gradient scales
  1e-4, 1 and 1e4 (so a norm threshold is crossed wherever it lies in
  between), relative tolerance 1e-6. The answer is kept for the optimizer
  object (the executor and its oracle ask once).

  Raises:
    ValueError: where the optimizer cannot step on the stand-in (then the
      caller must name the scope).
  """
  params, stale = _stand_in(0), _stand_in(1)
  grads = [[jax.tree.map(lambda v, k=k, c=scale: v * c * (k + 1),
                         _stand_in(2 + k)) for k in range(2)]
           for scale in _SCALES]

  def together_and_apart(grads):
    return [(_updates(optimizer, params, g, stale),
             [_updates(optimizer, params[s], [step[s] for step in g],
                       stale[s]) for s in range(2)]) for g in grads]

  if id(optimizer) in _SEEN:  # an executor and its oracle share one rule
    return _SEEN[id(optimizer)][1]
  try:
    runs = together_and_apart(grads)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"cannot tell whether the optimizer couples stages (it fails on a "
        f"stand-in model: {type(e).__name__}: {str(e).splitlines()[0]}); "
        "valid: optimizer_scope='model' or 'stage'") from e
  couples = any(
      not np.allclose(a, b, rtol=1e-6, atol=0)
      for together, apart in runs for step, whole in enumerate(together)
      for s in range(2) for a, b in zip(jax.tree.leaves(whole[s]),
                                        jax.tree.leaves(apart[s][step])))
  if len(_SEEN) >= 64:
    _SEEN.pop(next(iter(_SEEN)))
  _SEEN[id(optimizer)] = (optimizer, couples)  # held: its id stays its own
  return couples


def resolve(scope: str, optimizer, schedule) -> str:
  """"model" or "stage": what `scope` means for this optimizer and schedule.

  Raises:
    ValueError: in one line, for an unknown scope, a whole-model rule the
      schedule cannot apply at once on every stage, or a whole-model rule
      that predicts weights.
  """
  if scope not in SCOPES:
    raise ValueError(f"optimizer_scope={scope!r} is invalid; valid: "
                     f"{', '.join(SCOPES)}")
  if scope == "stage":
    return scope
  couples = couples_stages(optimizer)
  if scope == "auto" and not couples:
    return "stage"
  why = ("the optimizer reduces over the whole model (e.g. a global norm)"
         if couples else "optimizer_scope='model' was asked for")
  if contract.predicts(optimizer):
    raise ValueError(f"{why}, but a whole-model update with weight "
                     "prediction is not supported; valid: "
                     "optimizer_scope='stage' (each stage's own tree)")
  try:
    together = schedule.together()
    program.compile_program(together)
    _check_one_staleness(together)
  except ValueError as e:
    raise ValueError(
        f"{why}, but schedule {schedule.name!r} cannot apply a minibatch's "
        "update on every stage at once (a stage reads or accumulates before "
        "another stage's gradient of it is finished); valid: a flush "
        "schedule (gpipe, 1f1b, zb-h1, zb-h2, timeprest, zb-async), or "
        "optimizer_scope='stage' to run the rule on each stage's own tree"
    ) from e
  return "model"


def _check_one_staleness(schedule) -> None:
  """Every stage's gradient of a minibatch is computed on, and applied
  after, the same number of its stage's updates: the whole model's update
  rule gets one `staleness` and one version of `stale_params`."""
  stream = schedule.with_minibatches(4 * schedule.num_minibatches)
  for p in range(stream.num_minibatches):
    seen = {(stream.update_version(s, p) - stream.forward_version(s, p),
             stream.update_version(s, p) - stream.gradient_version(s, p))
            for s in range(stream.num_stages)}
    if len(seen) > 1:
      raise ValueError(f"minibatch {p}'s stages differ in staleness {seen}")


def init_states(optimizer, scope: str, stage_params) -> list:
  """Per stage, the optimizer state it holds: its own tree's, or (scope
  "model") a copy of the whole model's (the tuple of stage trees)."""
  if scope == "model":
    return [optimizer.init(tuple(stage_params))] * len(stage_params)
  return [optimizer.init(p) for p in stage_params]
