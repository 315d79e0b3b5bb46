"""How a tick dispatches each stage's task: one place, several lowerings.

In the SPMD program every device runs the same tick, so the choice of what a
device does (its stage's function, its task's kind) is data-dependent
control flow. How that is lowered matters for speed: XLA:CPU runs a
`lax.switch` inside `lax.scan` as a conditional in the loop, while XLA:GPU
may sync with the host for each conditional in a loop (jax issues 5986 and
2491). Each lowering here takes the same arguments, so the executor can swap
one for another (`Pipeline(..., lowering=...)`) and benchmarks can compare
them.
"""

from typing import Callable, Sequence

import jax


def nested_switch(stage, code, branches: Sequence[Sequence[Callable]], *args):
  """`lax.switch` over stages, then over the task's kind code."""
  per_stage = [lambda c, *a, row=row: jax.lax.switch(c, row, *a)
               for row in branches]
  return jax.lax.switch(stage, per_stage, code, *args)


def flat_switch(stage, code, branches: Sequence[Sequence[Callable]], *args):
  """One `lax.switch` over (stage, kind code) pairs."""
  width = len(branches[0])
  flat = [fn for row in branches for fn in row]
  return jax.lax.switch(stage * width + code, flat, *args)


def select_all(stage, code, branches: Sequence[Sequence[Callable]], *args):
  """Every (stage, kind) branch runs; `lax.select_n` keeps this device's.

  No conditional at all, at the price of running every branch each tick:
  for measuring what conditionals in a loop cost (e.g. on XLA:GPU), not for
  training.
  """
  width = len(branches[0])
  outs = [fn(*args) for row in branches for fn in row]
  index = stage * width + code
  return jax.tree.map(lambda *v: jax.lax.select_n(index, *v), *outs)


LOWERINGS = {"nested_switch": nested_switch, "flat_switch": flat_switch,
             "select_all": select_all}


def get(name: str) -> Callable:
  """The lowering registered under `name`."""
  if name not in LOWERINGS:
    raise ValueError(f"lowering {name!r} is invalid; valid: "
                     f"{', '.join(LOWERINGS)}")
  return LOWERINGS[name]
