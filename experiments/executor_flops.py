"""Compute efficiency of the executor: FLOPs executed over the schedule's.

1. Probes how XLA's cost analysis (JAX 0.10.2, CPU) counts a `while` (scan)
   and a `conditional` (switch) on tiny programs.
2. Because a `while` body counts once and a `conditional` counts its dearest
   branch, the whole step's figure is one tick, not the FLOPs executed. So
   executed FLOPs are summed over a window's table: for every (tick, stage)
   the compiled cost of the branch that stage takes there (each (stage, kind)
   branch compiled alone, written as the executor writes it), plus the
   optimizer updates, plus an upper bound on the per-tick bookkeeping (the
   whole step's figure less its dearest branch and update).
3. Useful FLOPs are the tasks the schedule names: F = the stage's forward, B =
   the backward as implemented (recomputed forward + vjp). Reported also with
   B counted as 2 x forward, and against the MaxText-style GPipe baseline
   (`baseline_gpipe.py`, unrolled so that its cost analysis is the executed
   count), whose bubbles cost (M+S-1)/M.

  .venv/bin/python experiments/executor_flops.py [--hidden=512] [--batch=32] \
      [--layers=2] [--out_dir=DIR]
"""

import json

import executor_common as common  # pylint: disable=g-bad-import-order

import jax
import jax.numpy as jnp
import numpy as np
import optax

import baseline_gpipe
import harness
import stalepipe as sp
from stalepipe.pipeline import executor
from stalepipe.pipeline import program as program_lib
from stalepipe.models.losses import cross_entropy as classification_loss

S = 4


def flops(fn, *args) -> float:
  return compiled_flops(jax.jit(fn).lower(*args).compile())


def compiled_flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


def probe_cost_analysis() -> dict:
  """How `cost_analysis` counts loops and conditionals, on 64x64 matmuls."""
  x = jnp.ones((64, 64))
  w = jnp.ones((64, 64))
  matmul = flops(lambda x, w: x @ w, x, w)

  def scan(n):
    return lambda x, w: jax.lax.scan(lambda c, _: (c @ w, None), x, None,
                                     length=n)[0]

  def switch(x, w, i):
    return jax.lax.switch(i, [lambda: x, lambda: x @ w, lambda: x @ w @ w,
                              lambda: x @ w @ w @ w])

  def scan_of_switch(x, w):
    body = lambda c, i: (jax.lax.switch(i, [lambda: c, lambda: c @ w,
                                            lambda: c @ w @ w]), None)
    return jax.lax.scan(body, x, jnp.arange(8) % 3)[0]

  return {
      "matmul": matmul,
      "scan_1_in_matmuls": flops(scan(1), x, w) / matmul,
      "scan_16_in_matmuls": flops(scan(16), x, w) / matmul,
      "switch_0_1_2_3_in_matmuls": flops(switch, x, w, 1) / matmul,
      "scan_8_of_switch_0_1_2_in_matmuls": flops(scan_of_switch, x, w) / matmul,
  }


def branch_costs(staged, micro: int, batch: int, hidden: int) -> dict:
  """FLOPs of each stage's F, B (as implemented) and update, alone.

  Written as the executor's branches: F runs the stage (the last stage adds
  its loss); B recomputes the forward and takes the vjp (the last stage: the
  gradient of loss / M), adds into the gradient accumulator and, except on
  stage 0, returns the input's cotangent to send.
  """
  x = jnp.ones((batch, hidden), jnp.float32)
  y = jnp.zeros((batch,), jnp.int32)
  opt = optax.sgd(0.1)
  out = []
  for s, (fn, p) in enumerate(zip(staged.stage_fns, staged.stage_params)):
    last = s == len(staged.stage_fns) - 1
    accumulate = lambda acc, g: jax.tree.map(jnp.add, acc, g)
    if last:
      forward = lambda p, x: classification_loss(fn(p, x), y)  # pylint: disable=cell-var-from-loop
      objective = lambda p, x: classification_loss(fn(p, x), y) / micro  # pylint: disable=cell-var-from-loop
      backward = lambda p, x, acc: accumulate(  # pylint: disable=cell-var-from-loop
          acc, jax.grad(objective, (0, 1))(p, x)[0])
      b_cost = flops(backward, p, x, p)
    else:
      forward = fn

      def backward(p, x, ct, acc, fn=fn, send=s > 0):
        g_p, g_x = jax.vjp(fn, p, x)[1](ct)
        # Stage 0 sends no input cotangent, so XLA drops its matmul.
        return accumulate(acc, g_p), (g_x if send else None)

      b_cost = flops(backward, p, x, x, p)
    update = lambda p, g, st: optax.apply_updates(p, opt.update(g, st, p)[0])
    out.append({"F": flops(forward, p, x), "B": b_cost,
                "recompute": flops(fn, p, x),
                "update": flops(update, p, p, opt.init(p))})
  return out


def table_flops(program: program_lib.Program, costs: list) -> dict:
  """Useful FLOPs (B as implemented and B = 2F) and updates of the steady
  window's table."""
  kinds = program.tables.kind[-1]
  width = program.backward_width
  code = lambda name: (program.kind_code(name) if name in program.kinds  # pylint: disable=unnecessary-lambda-assignment
                       else -1)
  useful = two_f = recompute = backward = updates = 0.0
  counts = {"F": 0, "B": 0, "FB": 0}
  for s, c in enumerate(costs):
    n_f = int(np.sum(kinds[:, s] == code("F")))
    n_b = width * int(np.sum(kinds[:, s] == code("B")))
    n_fb = width * int(np.sum(kinds[:, s] == code("FB")))
    counts["F"] += n_f
    counts["B"] += n_b
    counts["FB"] += n_fb
    # A fused FB runs its forward once: no recompute.
    useful += n_f * c["F"] + (n_b + n_fb) * c["B"]
    two_f += (n_f + 2 * n_b + 3 * n_fb) * c["recompute"]
    recompute += n_b * c["recompute"]
    backward += n_b * c["B"]
    updates += int(np.sum(program.tables.update[-1][:, s])) * c["update"]
  busy = float(np.mean(kinds != program_lib.IDLE))
  return {"useful": useful, "useful_B_as_2F": two_f, "recompute": recompute,
          "backward": backward,
          "updates": updates, "ticks": int(kinds.shape[0]),
          "busy_slots": busy, "tasks": counts}


def whole_step_flops(staged, schedule, mesh, batch: int, hidden: int) -> float:
  pipe = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                           optax.sgd(0.1), mesh)
  state = pipe.init(staged.stage_params)
  x, y = common.make_batch(schedule.num_minibatches,
                           schedule.num_microbatches, 2 * batch, hidden)
  step_fn, _, _ = common.step_function(pipe, state, x, y)
  return compiled_flops(step_fn)


def baseline_flops(staged, mesh, micro: int, batch: int, hidden: int) -> float:
  base = baseline_gpipe.GPipeBaseline(baseline_gpipe.mlp_stage,
                                      classification_loss, optax.sgd(0.1),
                                      mesh, unroll=True)
  params, opt_state = base.init(staged.stage_params)
  x, y = common.make_batch(1, micro, 2 * batch, hidden)
  xs, ys = base.put_batch(x[0], y[0])
  cost = base.step.lower(params, opt_state, xs, ys).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def main(argv):
  del argv
  H, b = common.HIDDEN.value, common.BATCH.value
  mesh = jax.make_mesh((2, S), ("data", "stage"))
  staged = common.make_model(S, H, common.LAYERS.value)
  results = {"probe": probe_cost_analysis()}
  print("cost analysis probe:", json.dumps(results["probe"]))
  rows = []
  for name, M, B in ([("gpipe", m, 1) for m in (4, 8, 16)]
                     + [(n, 4, 2) for n in common.ASYNC]):
    schedule = common.make_schedule(name, S, M, B)
    program = program_lib.compile_program(schedule)
    costs = branch_costs(staged, M, b, H)
    t = table_flops(program, costs)
    executed = t["useful"] + t["updates"]
    row = {"schedule": name, "M": M, "B": B, **t}
    whole = whole_step_flops(staged, schedule, mesh, b, H)
    dearest = max(max(c["F"], c["B"] * program.backward_width)
                  for c in costs)
    per_tick = max(whole - dearest - max(c["update"] for c in costs), 0.0)
    row["whole_step_cost_analysis_per_device"] = whole
    row["tick_overhead_bound_per_stage"] = per_tick
    executed += S * t["ticks"] * per_tick
    row["executed"] = executed
    row["executed_over_useful"] = executed / t["useful"]
    row["useful_share"] = t["useful"] / executed
    row["executed_over_useful_B_as_2F"] = executed / t["useful_B_as_2F"]
    row["recompute_share_of_B"] = t["recompute"] / max(t["backward"], 1.0)
    if name == "gpipe":
      per_device = baseline_flops(staged, mesh, M, b, H)
      row["baseline_executed"] = S * per_device
      row["baseline_over_useful_B_as_2F"] = S * per_device / t["useful_B_as_2F"]
      row["spmd_with_bubbles_theory"] = (M + S - 1) / M
    rows.append(row)
    print(json.dumps(row))
  results["schedules"] = rows
  harness.record("executor_flops", results)


if __name__ == "__main__":
  harness.run(main)
