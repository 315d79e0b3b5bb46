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
  it is finished; the update rule runs on the whole model's tree (`join`:
  a cut module's own nested dict, else the tuple of the stages' trees; the
  gradient, weights and optimizer state gathered across 'stage') and
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
  """Two small stage trees of random values, parts of one module's tree."""
  rng = np.random.default_rng(seed)
  return tuple({f"stage{s}": {
      "a": rng.normal(size=(3,)).astype(np.float32),
      "b": rng.normal(size=(2, 2)).astype(np.float32) + s}} for s in range(2))


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
    return [([parts(u, params) for u in _updates(
        optimizer, join(params), [join(step) for step in g], join(stale))],
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


def resolve(scope: str, optimizer, schedule, tied=()) -> str:
  """"model" or "stage": what `scope` means for this optimizer and schedule
  (and `tied` parameters: they need "model", one update on every copy).

  Raises:
    ValueError: in one line, for an unknown scope, a whole-model rule the
      schedule cannot apply at once on every stage, a whole-model rule that
      predicts weights, or tied parameters per stage.
  """
  if scope not in SCOPES:
    raise ValueError(f"optimizer_scope={scope!r} is invalid; valid: "
                     f"{', '.join(SCOPES)}")
  if tied and scope == "stage":
    raise ValueError(f"parameters {sorted(tied)} are tied across stages, but "
                     "optimizer_scope='stage' would update each copy on its "
                     "own; valid: optimizer_scope='model' or 'auto' (their "
                     "gradients summed, one update applied on every copy)")
  if scope == "stage":
    return scope
  couples = scope == "auto" and not tied and couples_stages(optimizer)
  if scope == "auto" and not couples and not tied:
    return "stage"
  why = ("the optimizer reduces over the whole model (e.g. a global norm)"
         if couples else f"parameters {sorted(tied)} are tied across stages"
         if tied else "optimizer_scope='model' was asked for")
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
        "schedule (gpipe, 1f1b, zb-h1, zb-h2, timeprest, zb-async)" + (
            "" if tied else ", or optimizer_scope='stage' to run the rule on "
            "each stage's own tree")) from e
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


def leaf_name(path) -> str:
  """A leaf's dotted name from its key path: `"blocks.0.attn.kernel"`."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _names(tree) -> list[str]:
  return [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _joinable(stage_trees, tied) -> bool:
  """Whether the stage trees are nested dicts whose leaves, the `tied` ones
  aside, are disjoint (`models.cut`'s: parts of one module's tree)."""
  if not all(isinstance(t, dict) for t in stage_trees):
    return False
  names = [n for t in stage_trees for n in _names(t) if n not in tied]
  return len(names) == len(set(names))


def check_tied(stage_trees, tied) -> None:
  """Refuses `tied` names that are not leaves of two or more of `cut`'s
  stage trees.

  Raises:
    ValueError: in one line, naming the leaf.
  """
  if not tied:
    return
  if not _joinable(stage_trees, frozenset(tied)):
    raise ValueError("tied parameters need stage trees that are parts of one "
                     "module's nested dict; valid: sp.models.cut(..., tied=) "
                     "and its stage_params")
  for name in tied:
    holders = [s for s, t in enumerate(stage_trees) if name in _names(t)]
    if len(holders) < 2:
      raise ValueError(f"tied parameter {name!r} is held by stages {holders}; "
                       "valid: a parameter two or more stages hold")


def _merge(a: dict, b: dict, add: bool) -> dict:
  out = dict(a)
  for k, v in b.items():
    if k not in out:
      out[k] = v
    elif isinstance(v, dict):
      out[k] = _merge(out[k], v, add)
    elif add:  # a tied leaf: the sum of its stages' gradients
      out[k] = out[k] + v
  return out


def join(stage_trees, tied=frozenset(), add: bool = False):
  r"""The whole model's tree the update rule steps on: stage trees that are
  parts of one nested dict (`models.cut`'s) joined back into it, so a mask
  or label function sees the module's own paths; other stage trees (e.g.
  `models.split`'s tuples) as their tuple.

  A `tied` leaf (held by several stages: a head tied to the embedding)
  appears once: with `add` (gradients) the sum of its stages' values,

  .. math:: g_w = \sum_{s \ni w} g_w^{(s)},

  as Megatron's embedding group all-reduces it, else (weights, every copy
  the same) the first stage's.
  """
  stage_trees = tuple(stage_trees)
  if not _joinable(stage_trees, tied):
    return stage_trees
  tree = {}
  for t in stage_trees:
    tree = _merge(tree, t, add)
  return tree


def parts(tree, stage_trees, tied=frozenset()) -> tuple:
  """`join`'s inverse: `tree`, shaped like `join(stage_trees)`, as one tree
  per stage shaped like `stage_trees` (a tied leaf's one value on every
  stage that holds it: one update applied on all)."""
  stage_trees = tuple(stage_trees)
  if not _joinable(stage_trees, tied):
    return tuple(tree)

  def like(t, shape):
    return {k: like(t[k], v) for k, v in shape.items()} if isinstance(
        shape, dict) else t

  return tuple(like(tree, t) for t in stage_trees)


def init_states(optimizer, scope: str, stage_params,
                tied=frozenset()) -> list:
  """Per stage, the optimizer state it holds: its own tree's, or (scope
  "model") a copy of the whole model's (`join` of the stage trees).

  Raises:
    ValueError: in one line, where the optimizer cannot initialise on the
      tree it steps on (a mask or labels given as a tree that fits another),
      or for invalid `tied` names (`check_tied`).
  """
  check_tied(stage_params, tied)
  trees = ([join(stage_params, tied)] if scope == "model"
           else list(stage_params))
  states = []
  for s, tree in enumerate(trees):
    try:
      states.append(optimizer.init(tree))
    except (ValueError, TypeError, KeyError) as e:
      where = "the whole model's" if scope == "model" else f"stage {s}'s"
      raise ValueError(
          f"the optimizer fails on {where} parameters ({type(e).__name__}: "
          f"{str(e).splitlines()[0] if str(e) else ''}); valid: masks and "
          "labels as functions of the parameters (optax takes a callable), "
          "or optimizer_scope='model' (the whole module's tree)") from e
  return states * len(stage_params) if scope == "model" else states
