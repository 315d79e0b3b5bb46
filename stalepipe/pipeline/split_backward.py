"""Splitting a stage's backward into input- and weight-gradient parts.

Zero-bubble schedules split a stage's backward into BI (the input gradient,
which the previous stage waits for) and BW (the weight gradient, which fills
bubbles) (Qi et al, Zero Bubble Pipeline Parallelism
<https://arxiv.org/abs/2401.10241>, ICLR 2024, §2). For a weight op
:math:`y = x W` the paper's B and W are

.. math::

  \\bar x = \\bar y W^\\top \\quad (BI), \\qquad
  \\bar W = x^\\top \\bar y \\quad (BW),

so BI keeps each weight op's output cotangent :math:`\\bar y` and BW needs
only it and the op's kept input :math:`x`: BW never re-derives the chain of
cotangents through the stage that BI computed.

Here the split is made on the jaxpr of any stage objective :math:`f(p, x)`
(the stage, or on the last stage its loss with the target): a variable is
*weight-side* when it is derived from the weights :math:`p` alone and
*activation-side* when it depends on the input or target. A *weight op* is
an equation (call primitives such as pjit or custom_jvp_call taken whole)
with an activation-side input and a floating weight-side input; every path
from :math:`p` to the output passes through one. With a zero perturbation
:math:`\\epsilon_e` added to each weight op's floating outputs,

.. math::

  (\\bar x, \\{\\bar y_e\\}) = \\mathrm{vjp}_{(x, \\epsilon)}
      f'(p, x, \\epsilon)\\big|_{\\epsilon = 0}(\\bar f) \\quad (BI),
  \\qquad
  \\bar p = \\nabla_p \\sum_e \\langle y_e(w_e(p), a_e), \\bar y_e \\rangle
  \\quad (BW),

with :math:`w_e(p)` the op's weight-side inputs (recomputed from :math:`p`:
casts, reshapes) and :math:`a_e` its activation-side inputs, kept by the
forward. BI differentiates with respect to :math:`(x, \\epsilon)` only, so
it holds no weight-gradient work; BW runs only the weight ops' pullbacks with
respect to their weight-side inputs. The forward keeps only those
:math:`a_e` BW reads (a bias add's input is not), and none that is the
stage's input or target; BI keeps each distinct :math:`\bar y_e` once (a
bias add hands its cotangent to the matmul before it unchanged: one array).
"""

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.extend import core as jcore
import jax.numpy as jnp

from stalepipe.pipeline import packing

WEIGHT, ACTIVATION, CONSTANT = "weight", "activation", "constant"


class Split(NamedTuple):
  """One stage objective's jaxpr, cut at its weight ops."""

  jaxpr: jcore.ClosedJaxpr  # f(p leaves, x leaves, target leaves)
  out_tree: Any  # the objective's output structure
  sides: tuple[str, ...]  # per equation: the side of its outputs
  weight_ops: frozenset  # indices of the weight ops among the equations
  stored: tuple  # activation-side vars the forward keeps for BW (a_e)
  unread: tuple  # activation-side inputs of weight ops BW never reads
  cotangents: tuple  # ShapeDtypeStruct of each weight op's float output
  kept: tuple  # which of those BI keeps: one of each set of identical ones
  kept_index: tuple  # per weight op output, its cotangent's index in `kept`


class Layout(NamedTuple):
  """Every stage's split, and the packing of the op cotangents BI keeps."""

  stages: tuple[Split, ...]
  packing: packing.Packing  # per stage, its weight ops' output cotangents

  @property
  def bytes_per_slot(self) -> int:
    """Bytes one micro-batch's kept op cotangents take in a buffer slot."""
    return self.packing.row_bytes


def _is_var(v) -> bool:
  return not isinstance(v, jcore.Literal)


def _perturbed(v) -> bool:
  """Whether an op output carries a cotangent (floating, not dropped)."""
  return (not isinstance(v, jcore.DropVar)
          and jnp.issubdtype(v.aval.dtype, jnp.inexact))


def _sides(jaxpr: jcore.Jaxpr, num_weights: int) -> tuple[dict, tuple]:
  """Each var's side (weight-side, activation-side or constant) and each
  equation's (that of its inputs, so of its outputs)."""
  side = {v: CONSTANT for v in jaxpr.constvars}
  side.update({v: WEIGHT if i < num_weights else ACTIVATION
               for i, v in enumerate(jaxpr.invars)})
  per_eqn = []
  for eqn in jaxpr.eqns:
    ins = {side[v] for v in eqn.invars if _is_var(v)}
    per_eqn.append(ACTIVATION if ACTIVATION in ins else WEIGHT
                   if WEIGHT in ins else CONSTANT)
    side.update({v: per_eqn[-1] for v in eqn.outvars})
  return side, tuple(per_eqn)


def _is_weight_op(eqn, side: dict) -> bool:
  ins = [v for v in eqn.invars if _is_var(v)]
  return (any(side[v] == ACTIVATION for v in ins)
          and any(side[v] == WEIGHT and jnp.issubdtype(v.aval.dtype,
                                                       jnp.inexact)
                  for v in ins)
          and any(_perturbed(v) for v in eqn.outvars))


def _bind(eqn, invals: list) -> list:
  """One equation applied to values, as `jax.core.eval_jaxpr` applies it."""
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals,
                             **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _evaluate(split: Split, leaves: list, eps=None, kept=None):
  """Runs the jaxpr on the leaves of (p, x, target).

  With `eps`: the whole objective, each weight op's float outputs plus its
  `eps` (F and BI); returns the outputs and the activations to keep. With
  `kept` (BW): only what depends on the weights alone and the weight ops,
  their activation-side inputs read from `kept`; returns the weight ops'
  float outputs.
  """
  jaxpr = split.jaxpr.jaxpr
  env = dict(zip(jaxpr.constvars, split.jaxpr.consts))
  env.update(zip(jaxpr.invars, leaves))
  if kept is not None:
    env.update(zip(split.stored, kept))
    env.update({v: jnp.zeros(v.aval.shape, v.aval.dtype)
                for v in split.unread})  # what BW does not read
  eps, op_outputs = iter(eps or ()), []
  for i, eqn in enumerate(jaxpr.eqns):
    op = i in split.weight_ops
    if kept is not None and split.sides[i] == ACTIVATION and not op:
      continue
    outs = _bind(eqn, [v.val if not _is_var(v) else env[v]
                       for v in eqn.invars])
    for v, y in zip(eqn.outvars, outs):
      if op and _perturbed(v):
        y = y if kept is not None else y + next(eps)
        op_outputs.append(y)
      if kept is None or not op:  # BW reads activations from `kept` only
        env[v] = y
  if kept is not None:
    return op_outputs
  return [env[v] if _is_var(v) else v.val for v in jaxpr.outvars], [
      env[v] for v in split.stored]


def forward(split: Split, p, x, target):
  """F: the objective, and what BI and BW need of it.

  Returns:
    The objective's value and `(pullback, activations)`: the pullback of the
    perturbed objective with respect to `(x, eps)` (BI) and the weight ops'
    activation-side inputs BW reads (a_e).
  """
  eps = [jnp.zeros(c.shape, c.dtype) for c in split.cotangents]

  def perturbed(x, eps):
    outs, kept = _evaluate(split, jax.tree.leaves((p, x, target)), eps=eps)
    return jax.tree.unflatten(split.out_tree, outs), kept

  out, pullback, kept = jax.vjp(perturbed, x, eps, has_aux=True)
  return out, (pullback, kept)


def input_gradient(split: Split, pullback: Callable, cotangent):
  """BI: the input's cotangent and the weight ops' output cotangents (one of
  each set of identical ones: a bias add passes its cotangent to the matmul
  before it unchanged)."""
  g_x, op_cotangents = pullback(cotangent)
  return g_x, [op_cotangents[i] for i in split.kept]


def weight_gradient(split: Split, p, x, target, kept: Sequence,
                    op_cotangents: Sequence):
  """BW: the weights' gradient from the kept activations and op cotangents,
  :math:`\\bar p = \\sum_e (\\partial y_e / \\partial p)^\\top \\bar y_e`."""
  def op_outputs(p):
    return _evaluate(split, jax.tree.leaves((p, x, target)), kept=list(kept))

  _, pullback = jax.vjp(op_outputs, p)
  return pullback([op_cotangents[i] for i in split.kept_index])[0]


def read_inputs(jaxpr: jcore.Jaxpr) -> list[bool]:
  """Which of the jaxpr's inputs its outputs depend on (dead code dropped,
  as jit drops it)."""
  live = {v for v in jaxpr.outvars if _is_var(v)}
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if _is_var(v))
  return [v in live for v in jaxpr.invars]


def _identical_cotangents(split: Split, p, x, target) -> Split:
  """Which op cotangents BI's pullback returns as one array (traced
  abstractly): BI keeps each once."""
  found = {}

  def trace(p, x, t):
    out, (pullback, _) = forward(split, p, x, t)
    _, cots = pullback(jax.tree.map(jnp.ones_like, out))
    firsts = [next(j for j, c in enumerate(cots) if c is cot) for cot in cots]
    found["kept"] = tuple(dict.fromkeys(firsts))
    found["index"] = tuple(found["kept"].index(j) for j in firsts)

  jax.eval_shape(trace, p, x, target)
  return split._replace(kept=found["kept"], kept_index=found["index"])


def analyse(objective: Callable, p, x, target) -> Split:
  """Traces `objective(p, x, target)` and cuts it at its weight ops.

  Args:
    objective: the stage's objective (`residuals.objective`, the target an
      argument); a scalar loss or the stage's output.
    p, x, target: its arguments, or their shapes (`jax.ShapeDtypeStruct`);
      `target` may be None.

  Raises:
    ValueError: if an output of the objective depends on the weights alone.
  """
  closed, shape = jax.make_jaxpr(objective, return_shape=True)(p, x, target)
  jaxpr, num_weights = closed.jaxpr, len(jax.tree.leaves(p))
  side, sides = _sides(jaxpr, num_weights)
  if any(_is_var(v) and side[v] == WEIGHT for v in jaxpr.outvars):
    raise ValueError("a stage objective whose output depends on the weights "
                     "alone cannot be split; valid: outputs that depend on "
                     "the input (or use remat='recompute')")
  ops = frozenset(i for i, eqn in enumerate(jaxpr.eqns)
                  if _is_weight_op(eqn, side))
  inputs = set(jaxpr.invars)
  acts = tuple(dict.fromkeys(
      v for i in sorted(ops) for v in jaxpr.eqns[i].invars
      if _is_var(v) and side[v] == ACTIVATION and v not in inputs))
  draft = Split(
      jaxpr=closed, out_tree=jax.tree.structure(shape),
      sides=sides,
      weight_ops=ops, stored=acts, unread=(), kept=(), kept_index=(),
      cotangents=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                       for i in sorted(ops) for v in jaxpr.eqns[i].outvars
                       if _perturbed(v)))
  draft = _identical_cotangents(draft, p, x, target)
  avals = lambda vs: [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)  # pylint: disable=unnecessary-lambda-assignment
                      for v in vs]
  bw = jax.make_jaxpr(functools.partial(weight_gradient, draft))(
      p, x, target, avals(acts), [draft.cotangents[i] for i in draft.kept])
  start = len(jax.tree.leaves((p, x, target)))
  read = read_inputs(bw.jaxpr)[start:start + len(acts)]
  return draft._replace(
      stored=tuple(v for v, r in zip(acts, read) if r),
      unread=tuple(v for v, r in zip(acts, read) if not r))


def analyse_all(objectives: Sequence[Callable], params: Sequence[Any],
                inputs: Sequence[Any], target) -> Layout:
  """Every stage's split (`analyse`), the last stage's with the target."""
  stages = tuple(
      analyse(f, p, x, target if s == len(objectives) - 1 else None)
      for s, (f, p, x) in enumerate(zip(objectives, params, inputs)))
  return Layout(stages, packing.Packing(
      [[s.cotangents[i] for i in s.kept] for s in stages]))
