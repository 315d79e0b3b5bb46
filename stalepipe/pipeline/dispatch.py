"""How a tick dispatches each stage's task: one place, several lowerings.

In the SPMD program every device runs the same tick, so the choice of what a
device does (its stage's function, its task's kind) is data-dependent
control flow. How that is lowered matters for speed: XLA:CPU runs a
`lax.switch` inside `lax.scan` as a conditional in the loop, while XLA:GPU
may sync with the host for each conditional in a loop (jax issues 5986 and
2491). Each lowering here takes the same arguments, so the executor can swap
one for another (`Pipeline(..., lowering=...)`) and benchmarks can compare
them: `branches[stage][code]` all take the same arguments and return the
same structure, and code 0 is the same on every stage (an idle tick).
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


def cond_chain(stage, code, branches: Sequence[Sequence[Callable]], *args):
  """One two-way `lax.cond` per (stage, kind), in sequence; code 0 (idle)
  is the starting value.

  A multi-way conditional copies every buffer a branch returns unchanged
  and another branch changes; a two-way conditional whose other branch
  passes its operands through does not (measured on XLA:CPU,
  docs/executor.md; `tick.run_tasks` keeps the gradient accumulator out of
  the task branches for that reason). Slower than `nested_switch` on busy
  schedules there, for the conditionals it adds.
  """
  result = branches[0][0](*args)
  for s, row in enumerate(branches):
    for k, fn in enumerate(row[1:], start=1):
      result = jax.lax.cond((stage == s) & (code == k),
                            lambda r, fn=fn: fn(*args), lambda r: r, result)
  return result


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
             "cond_chain": cond_chain, "select_all": select_all}


def get(name: str) -> Callable:
  """The lowering registered under `name`."""
  if name not in LOWERINGS:
    raise ValueError(f"lowering {name!r} is invalid; valid: "
                     f"{', '.join(LOWERINGS)}")
  return LOWERINGS[name]
