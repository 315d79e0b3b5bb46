"""Does step t's all-reduce feed step t+1's forward? SAPipe's overlap, checked.

SAPipe (seed 004 §3, §5) applies the gradient all-reduced at step t at step
t+1, so that the all-reduce overlaps step t+1's forward and backward. That is
possible only if nothing step t+1's forward or backward reads depends on the
all-reduce's result. This traces one update as the executor runs it (the
synchronised gradient G_t, this replica's own gradient l_t, the optimizer
state and weights in; the weights the next forward reads out, through
`predict` where the optimizer has it) and follows the data dependencies of
its jaxpr: an output depends on an input when a chain of equations joins
them (conservative: any input of an equation reaches all its outputs, also
through nested jaxprs).

It reports, for each update rule of `configs/sapipe.py` and its variants,
whether G_t reaches step t+1's forward weights (it must not) and whether it
reaches the weights after step t+1's update (it must: that is where it is
applied), and counts the parameter-sized all-reduce ops in the compiled
executor step (the update's, in the tick loop's body: one per update).

  .venv/bin/python experiments/sapipe_overlap.py [--out_dir=DIR]
"""

import re

import executor_common as common  # pylint: disable=g-bad-import-order

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

D = 4


def _leaves(tree):
  return jax.tree.leaves(tree)


def reaches(fn, args, source: int) -> list[bool]:
  """Per output leaf of `fn(*args)`, whether `args[source]` reaches it."""
  closed = jax.make_jaxpr(fn)(*args)
  counts = [len(_leaves(a)) for a in args]
  start = sum(counts[:source])
  tainted = set(closed.jaxpr.invars[start:start + counts[source]])
  for eqn in closed.jaxpr.eqns:
    if any(not isinstance(v, jex_core.Literal) and v in tainted
           for v in eqn.invars):
      tainted.update(eqn.outvars)
  return [not isinstance(v, jex_core.Literal) and v in tainted
          for v in closed.jaxpr.outvars]


def rules():
  sgd = optax.sgd(0.1, 0.9)
  return {
      "SAPipe WP option 3 + DC (configs/sapipe.py)":
          sp.optim.WeightPrediction(sgd, 3, num_workers=D, lam=0.2),
      "WP option 1": sp.optim.WeightPrediction(sgd, 1, num_workers=D),
      "WP option 2": sp.optim.WeightPrediction(sgd, 2, num_workers=D),
      "DC alone (stale_gradients(1) + full DC)": optax.chain(
          sp.optim.stale_gradients(1),
          sp.optim.delay_compensation(0.2, form="full", delay=1), sgd),
      "PipeSGD (stale_gradients(1))": optax.chain(
          sp.optim.stale_gradients(1), sgd),
      "non-stale BSP": sgd,
  }


def analyse(name, rule, params):
  """Whether G_t reaches step t+1's forward weights and its update."""
  del name
  predict = getattr(rule, "predict", lambda state, w, **_: w)

  def update(g, state, w, local):
    extra = ({"local_updates": local, "stale_params": w}
             if sp.pipeline.contract.takes_extra_args(rule) else {})
    updates, state = rule.update(g, state, w, **extra)
    return optax.apply_updates(w, updates), state

  def two_steps(g_t, local_t, g_next, local_next, state, w):
    w, state = update(g_t, state, w, local_t)
    forward_weights = predict(state, w, ahead=0, since_forward=0)
    w, state = update(g_next, state, w, local_next)
    return forward_weights, w

  state = rule.init(params)
  g = jax.tree.map(jnp.ones_like, params)
  out = reaches(two_steps, (g, g, g, g, state, params), source=0)
  n = len(_leaves(params))
  return {"feeds_next_forward": any(out[:n]),
          "applied_at_next_update": any(out[n:])}


def all_reduces(rule, staged):
  schedule = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1,
                               num_minibatches=2)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, rule,
                           jax.make_mesh((D, 1), ("data", "stage")))
  state = pipe.init(staged.stage_params)
  x, y = common.make_batch(2, 1, 2 * D, 8)
  hlo = pipe.compile(state, x, y).as_text()
  # parameter-sized (non-scalar) all-reduces: the gradients'
  return len(re.findall(r"= f32\[\d+\]\{0\} all-reduce(?:-start)?\(", hlo))


def main(argv):
  del argv
  np.set_printoptions(precision=3)
  staged = sp.models.split(sp.models.mlp(8, 16, 1, 8), 1)
  print(f"{'update rule':44s} {'G_t feeds t+1 forward':>22s} "
        f"{'G_t applied at t+1':>19s} {'all-reduces':>11s}")
  results = {}
  for name, rule in rules().items():
    r = analyse(name, rule, staged.stage_params[0])
    r["all_reduces"] = all_reduces(rule, staged)
    results[name] = r
    print(f"{name:44s} {str(r['feeds_next_forward']):>22s} "
          f"{str(r['applied_at_next_update']):>19s} "
          f"{r['all_reduces']:>11d}")
  harness.record("sapipe_overlap", results)


if __name__ == "__main__":
  harness.run(main)
