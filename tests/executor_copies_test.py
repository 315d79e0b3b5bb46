"""The compiled tick never copies the gradient accumulator through a branch.

XLA copies, in every branch of a multi-way conditional that passes a buffer
through, each buffer another branch changes. Before `tick.run_tasks` kept
the accumulator out of the task branches (and updates stopped zeroing it,
`tick.accumulated`), every tick that added no gradient copied it once in
the task `switch` and once more in the update `cond`: on the benchmarks'
MLP that was most of the step's overhead (docs/executor.md).
"""

import re

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

S, M, WIDTH = 2, 4, 12  # weights [12, 12]; activations [2, 12]


def _passthrough_copies(pipe, staged) -> list[str]:
  """`copy` ops in the compiled step whose operand is a tuple element (a
  buffer passed through) of the shape of an accumulator leaf."""
  state = pipe.init(staged.stage_params)
  x = np.zeros((1, M, 2, WIDTH), np.float32)
  y = np.zeros((1, M, 2), np.int32)
  hlo = pipe.compile(state, x, y).as_text()
  found = []
  for leaf in jax.tree.leaves(state.grads):
    local = leaf.shape[2:]  # [D, S, ...]: one device's block
    dims = ",".join(str(d) for d in local)
    pattern = (rf"= {leaf.dtype.name.replace('float', 'f')}\[{dims}\]"
               rf"\{{[\d,]*\}} copy\(%(get-tuple-element|param)")
    found += [m.group(0) for m in re.finditer(pattern, hlo)]
  return found


@pytest.mark.parametrize("layout", ["packed", "stacked"])
@pytest.mark.parametrize("name,remat", [("zb-h1", "residuals"),
                                        ("1f1b", "recompute"),
                                        ("pipedream", "recompute")])
def test_no_tick_copies_the_gradient_accumulator(name, remat, layout):
  staged = sp.models.split(
      sp.models.mlp(WIDTH, WIDTH, 2 * S - 1, WIDTH), S)
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=1)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optax.sgd(0.1), jax.make_mesh((1, S),
                                                         ("data", "stage")),
                           remat=remat, layout=layout)
  assert _passthrough_copies(pipe, staged) == []
