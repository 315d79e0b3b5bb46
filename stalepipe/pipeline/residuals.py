"""Keeping a forward's residuals for its backward tasks (`remat="residuals"`).

By default (`remat="recompute"`) a backward task recomputes its stage's
forward from the kept input, which costs a forward per backward task (36% of
a backward on the benchmark MLP; twice over when zero-bubble splits the
backward into input- and weight-gradient tasks). With `remat="residuals"` the
forward runs `jax.vjp` instead and keeps the pullback's residuals in a buffer
slot beside the input, and every backward task of that micro-batch calls the
pullback on them: no forward is recomputed.

The pullback of `jax.vjp` is a pytree whose leaves are its residuals. Leaves
that are the stage's weights, its input or the target (the last stage's loss
needs it) are not stored: the backward task reads them where they already
are (the weight ring, the activation buffer, the window's targets). Only the
other leaves (intermediate activations, masks) are stored, packed per dtype
like the weights (`packing.Packing`), in `Buffers.residuals`, `[C, L_res]`
per stage. Which leaf is which is found once, when the program is built, by
tracing each stage's `jax.vjp` abstractly.

Where a schedule splits the backward into input- and weight-gradient tasks
(zero-bubble's BI and BW), the forward runs `split_backward.forward`
instead: what it keeps is BI's pullback (with respect to the input and the
weight ops' outputs only) and the weight ops' inputs BW reads, sorted and
stored the same way; BI keeps the weight ops' output cotangents in
`Buffers.op_cotangents` for BW (`split_backward.py`).

The backward then differentiates at the forward's weights, so this needs
every backward task to read the version its forward read, and no weight
prediction between them; `check` refuses the rest.
"""

from typing import Any, Callable, NamedTuple, Sequence

import jax

from stalepipe.pipeline import packing

REMATS = ("recompute", "residuals")
WEIGHT, INPUT, TARGET, STORED = "weight", "input", "target", "stored"


class Layout(NamedTuple):
  """Each stage's pullback: its structure and where each leaf comes from."""

  treedefs: tuple  # per stage, the pullback's pytree structure
  sources: tuple  # per stage, per leaf: (WEIGHT|INPUT|TARGET|STORED, index)
  packing: packing.Packing  # the stored leaves of every stage

  @property
  def bytes_per_slot(self) -> int:
    """Bytes one micro-batch's stored residuals take in a buffer slot."""
    return self.packing.row_bytes


def objective(fn: Callable, loss_fn: Callable, last: bool, target) -> Callable:
  """What the forward differentiates: the stage, or on the last stage its
  loss (the scalar mean over the micro-batch)."""
  if not last:
    return fn
  return lambda p, x: loss_fn(fn(p, x), target)


def vjp(fn: Callable, loss_fn: Callable, last: bool) -> Callable:
  """The forward as `jax.vjp` runs it: `(p, x, target) -> (value,
  pullback)`, the pullback being what the backward tasks keep."""
  return lambda p, x, t: jax.vjp(objective(fn, loss_fn, last, t), p, x)


def analyse(forwards: Sequence[Callable], params: Sequence[Any],
            inputs: Sequence[jax.ShapeDtypeStruct],
            target: jax.ShapeDtypeStruct) -> Layout:
  """Traces each stage's forward abstractly and sorts what it keeps.

  Args:
    forwards: per stage, `(p, x, target) -> (value, kept)`: `vjp`, or
      `split_backward.forward` (the kept pytree's leaves are sorted).
    params: the S stages' weight pytrees (shapes matter).
    inputs: the S stages' inputs, one micro-batch each.
    target: one micro-batch's target.
  """
  treedefs, sources, stored = [], [], []
  for forward, p, x in zip(forwards, params, inputs):
    found = {}

    def trace(p, x, t, forward=forward, found=found):
      _, kept = forward(p, x, t)
      leaves, found["treedef"] = jax.tree.flatten(kept)
      known = ([(WEIGHT, j, w) for j, w in enumerate(jax.tree.leaves(p))]
               + [(INPUT, j, v) for j, v in enumerate(jax.tree.leaves(x))]
               + [(TARGET, j, v) for j, v in enumerate(jax.tree.leaves(t))])
      found["sources"], found["stored"] = [], []
      for leaf in leaves:
        source = next(((kind, j) for kind, j, v in known if leaf is v), None)
        if source is None:
          source = (STORED, len(found["stored"]))
          found["stored"].append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        found["sources"].append(source)

    jax.eval_shape(trace, p, x, target)
    treedefs.append(found["treedef"])
    sources.append(tuple(found["sources"]))
    stored.append(found["stored"])
  return Layout(tuple(treedefs), tuple(sources), packing.Packing(stored))


def keep(layout: Layout, s: int, kept) -> packing.Flat:
  """The stored leaves of what stage s's forward keeps, packed into one
  slot's row."""
  leaves = jax.tree.leaves(kept)
  return layout.packing.pack(s, [leaf for leaf, (kind, _) in
                                 zip(leaves, layout.sources[s])
                                 if kind == STORED])


def restore(layout: Layout, s: int, row: packing.Flat, weights, x, target):
  """What stage s's forward kept (its pullback), rebuilt from a slot's row
  and what is kept elsewhere (the weights, the input, the target)."""
  stored = layout.packing.unpack(s, row)
  known = {WEIGHT: jax.tree.leaves(weights), INPUT: jax.tree.leaves(x),
           TARGET: jax.tree.leaves(target),
           STORED: stored}
  leaves = [known[kind][j] for kind, j in layout.sources[s]]
  return jax.tree.unflatten(layout.treedefs[s], leaves)


def check(remat: str, schedule, optimizer) -> None:
  """Refuses a remat choice the schedule or update rule cannot run as asked."""
  if remat not in REMATS:
    raise ValueError(f"remat={remat!r} is invalid; valid: "
                     f"{', '.join(REMATS)}")
  if remat == "recompute":
    return
  if callable(getattr(optimizer, "predict", None)):
    raise ValueError("remat='residuals' differentiates at the forward's "
                     "weights, but the optimizer predicts the weights each "
                     "task reads; valid: remat='recompute'")
  stream = schedule.with_minibatches(4 * schedule.num_minibatches)
  if stream.backward_covers_minibatch and any(
      stream.kind(t).splits_backward for t in stream.tasks):
    raise ValueError(
        f"remat='residuals' splits one micro-batch's backward, but schedule "
        f"{schedule.name!r} splits backwards over a whole minibatch; valid: "
        "remat='recompute'")
  for t in stream.tasks:
    if stream.kind(t).runs_backward and stream.since_forward(t):
      raise ValueError(
          f"remat='residuals' differentiates at the forward's weights, but "
          f"schedule {schedule.name!r} runs {t.kind} of minibatch "
          f"{t.minibatch} on stage {t.stage} on newer weights than its "
          "forward; valid: remat='recompute'")
