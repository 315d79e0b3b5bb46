"""A stage sharded over 'fsdp': memory per device, collectives a tick and
step time, against the same pipeline with whole stages (F = 1).

S = 4 identical stages of the executor benchmarks' MLP (`layers` blocks
`H -> H` each, every leaf's dimensions divisible by 4, so no leaf is held
whole), Adam, on a ('data', 'stage', 'fsdp') mesh of (1, 2, F): the 4 stages
folded two a device onto 2 stage devices, each stage cut over F members, for
F in `--fsdp` (8 emulated devices hold F <= 4). The baseline F = 1 runs on
the 2-axis mesh ('data', 'stage') of (1, 2); a 3-axis mesh with F = 1 is
checked to give the same bytes. Every micro-batch holds `--batch` examples
whatever F: each member runs its 1/F of them, so every F does the same work.

1. Memory per device: from the state's arrays (one device's shard of each),
   the weight ring (every stashed version), the optimizer state, the gradient
   accumulator and the activation buffers; from the compiled step's
   `memory_analysis()`, its argument, output, alias and temp bytes. The aim
   per device is

   .. math::

     \\frac{ring_1 + opt_1 + grads_1}{F} + J \\cdot W

   with `ring_1 + opt_1 + grads_1` the F = 1 run's, W one stage's packed
   weights (the version a slot gathers before its task) and J the slots a
   device runs a tick (2 here).
2. Collectives, counted in the compiled (optimised) HLO text,
   `compiled.as_text()`: all-gather, reduce-scatter, all-reduce and
   collective-permute, with the mesh axes their device groups span and the
   bytes of their results, by where each sits in the call graph: in the
   tick (the scan's `while` body) outside any conditional, in the tick under
   a conditional (a `cond` or `switch` branch), or outside the loop. The
   loop body is compiled once, so its count is a tick's. The design, checked
   per run ("as designed"): per slot and dtype, a tick, one all-gather over
   'fsdp' of the version the slot's task reads and one reduce-scatter of its
   weight gradient, both outside any conditional, beside the F = 1 run's
   ops. With `--other_rules`, the same count for the first schedule at F = 1
   and the largest F with two rules that are not elementwise: global-norm
   clipping before Adam (model scope) and full delay compensation before SGD
   (stage scope), which gather the whole stage for the update.
3. Step time over the F = 1 run's, medians of `--repeats` interleaved rounds:
   a window, and the same window with every task made idle (what a tick
   costs besides its tasks: the gathers and reduce-scatters run in every
   tick, a slot with no task or no gradient included). The 2F devices share
   the host's CPU cores as the F = 1 run's 2 do, so a member's 1/F of the
   work does not finish sooner: the ratio is what sharding costs on top of
   the same work (the collectives, merging the gathered parts into the
   stage's tree and cutting its gradient into rows, the tick's bookkeeping
   that every member repeats), not a speed-up. Beside it, the shares of
   slot-ticks of the steady window's table with a task and with a weight
   gradient: a slot's all-gather in any other tick gathers a version no task
   reads, its reduce-scatter in a tick without a gradient reduces zeros.

  PYTHONPATH=. .venv/bin/python experiments/fsdp_memory.py [--hidden=256] \
      [--layers=4] [--batch=32] [--micro=4] [--fsdp=1,2,4] \
      [--schedules=1f1b,pipedream,zb-h1] [--repeats=5] [--other_rules] \
      [--out_dir=DIR]

References:
  Rajbhandari et al, ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models <https://arxiv.org/abs/1910.02054>, 2020 (stage 3).
"""

import collections
import re

import executor_common as common  # pylint: disable=g-bad-import-order

from absl import flags
import jax
import numpy as np
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import program as program_lib
from stalepipe.schedules import kinds

S, STAGE_DEVICES = 4, 2
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
PLACES = ("outside the loop", "tick", "tick, under a conditional")

_SCHEDULES = flags.DEFINE_list("schedules", ["1f1b", "pipedream", "zb-h1"],
                               "Schedules to run.")
_FSDP = flags.DEFINE_list("fsdp", ["1", "2", "4"],
                          "Members F of a stage on 'fsdp'; 1 is the baseline "
                          "and is always run.")
flags.register_validator(
    "fsdp", lambda v: all(f in ("1", "2", "4") for f in v),
    "valid: F in 1, 2, 4 (the (1, 2, F) mesh on 8 emulated devices)")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 2,
                                    "Minibatches per window.")
_OTHER_RULES = flags.DEFINE_bool(
    "other_rules", True, "Also count the collectives of two rules that are "
    "not elementwise (first schedule, F = 1 and the largest F).")
flags.FLAGS.set_default("hidden", 256)
flags.FLAGS.set_default("layers", 4)
flags.FLAGS.set_default("micro", 4)

RULES = {  # name: (optimizer, optimizer_scope)
    "adam": (lambda: optax.adam(1e-3), "stage"),
    "clip + adam, model scope": (lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "model"),
    "full dc + sgd, stage scope": (lambda: optax.chain(
        sp.optim.delay_compensation(0.5, form="full"), optax.sgd(0.1)),
                                   "stage"),
}

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_CALLS = re.compile(r"(body|condition|true_computation|false_computation|"
                    r"to_apply|calls)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COLLECTIVE = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) +
                         r")(?:-start)?\(")
_GROUPS = re.compile(r"(replica_groups|source_target_pairs)=(\{[{}\d,]*\})")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def mesh_of(F: int, axes: int = 3):
  """The (1, 2, F) mesh; `axes=2`: the ('data', 'stage') mesh (F = 1)."""
  devices = jax.devices()[:STAGE_DEVICES * F]
  if axes == 2:
    return jax.make_mesh((1, STAGE_DEVICES), ("data", "stage"),
                         devices=devices)
  return jax.make_mesh((1, STAGE_DEVICES, F), ("data", "stage", "fsdp"),
                       devices=devices)


def result_bytes(type_text: str) -> int:
  """Bytes of an HLO result type, e.g. `f32[2,131584]{1,0}` or a tuple."""
  return sum(_DTYPE_BYTES[dtype] * int(np.prod(
      [int(n) for n in dims.split(",") if n])) for dtype, dims in
             _ARRAY.findall(type_text))


def collectives(hlo: str, mesh) -> list[tuple[str, str, str, int]]:
  """Every collective op of a compiled module's text: (op, place, axes,
  result bytes). The place is one of `PLACES`, by the call graph from
  ENTRY (a `while` body is the tick; a `conditional`'s branch puts what it
  calls under a conditional; an op reached along several paths counts at
  its innermost place); the axes, the mesh axes its device groups span
  ("-": groups of one device, a collective over an axis of size 1)."""
  computations, ops, entry, name = {}, collections.defaultdict(list), None, None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = header.group(1)
      computations[name] = []
      entry = name if line.startswith("ENTRY") else entry
      continue
    if name is None or not line.startswith("  "):
      continue
    for kind, callee in _CALLS.findall(line):
      computations[name].append((callee, kind == "body", kind.endswith(
          "computation")))
    for listed in _BRANCHES.findall(line):
      computations[name].extend((c.strip().lstrip("%"), False, True)
                                for c in listed.split(","))
    op = _COLLECTIVE.search(line)
    if op:
      ops[name].append((op.group(2), axes_of(line, mesh),
                        result_bytes(op.group(1))))
  place, stack = {}, [(entry, 0)]
  while stack:  # depth: 0 outside the loop, 1 in the tick, 2 under a cond
    comp, depth = stack.pop()
    if place.get(comp, -1) >= depth:
      continue
    place[comp] = depth
    for callee, loop, branch in computations.get(comp, ()):
      stack.append((callee, 2 if branch and depth else max(depth, int(loop))))
  return [(op, PLACES[place[comp]], axes, size)
          for comp, found in ops.items() if comp in place
          for op, axes, size in found]


def axes_of(line: str, mesh) -> str:
  """The mesh axes along which an HLO collective's device groups (replica
  groups, or a permute's source-target pairs) vary."""
  groups = _GROUPS.search(line)
  ids = [[int(i) for i in g.split(",")] for g in
         re.findall(r"\{([\d,]+)\}", groups.group(2))] if groups else []
  spread = set()
  for group in ids:
    where = np.array(np.unravel_index(group, mesh.devices.shape))
    spread |= {a for a, row in zip(mesh.axis_names, where)
               if len(set(row)) > 1}
  return ",".join(a for a in mesh.axis_names if a in spread) or "-"


def per_place(found) -> dict:
  """`{place: {op: {axes: [count, bytes]}}}` of `collectives`' ops."""
  table = {p: {op: {} for op in COLLECTIVES} for p in PLACES}
  for op, where, axes, size in found:
    count = table[where][op].setdefault(axes, [0, 0])
    count[0] += 1
    count[1] += size
  return table


def build(name: str, F: int, staged, x, y, rule: str = "adam",
          axes: int = 3) -> dict:
  """One schedule's window step at F, compiled: its state's and its memory
  analysis's bytes, its collectives, and callables running a window and an
  idle one (every task made idle: the tick's own cost)."""
  schedule = common.make_schedule(name, S, x.shape[1], x.shape[0])
  mesh, (optimizer, scope) = mesh_of(F, axes), RULES[rule]
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer(), mesh, optimizer_scope=scope)
  state = pipe.init(staged.stage_params)
  compiled = pipe.compile(state, x, y)
  state, *args = pipe.arguments(state, x, y)
  idle_args = common.with_tables(args, common.cut_table(pipe.program, ()))
  memory = compiled.memory_analysis()
  bytes_of = {
      "ring": common.shard_bytes([r.params for r in state.ring]),
      "opt": common.shard_bytes(state.opt_state),
      "grads": common.shard_bytes(state.grads),
      "acts": common.shard_bytes(state.buffers),
      "arguments": memory.argument_size_in_bytes,
      "outputs": memory.output_size_in_bytes,
      "temps": memory.temp_size_in_bytes,
      "aliased": memory.alias_size_in_bytes}
  kind = pipe.program.tables.kind[-1]  # the steady window's [T, S]
  gradient = [c for c, k in enumerate(pipe.program.kinds, start=1)
              if kinds.WEIGHT_GRADIENT in kinds.kind(k).produces]
  box = [state]

  def run(call_args):
    box[0], metrics = compiled(box[0], *call_args)
    jax.block_until_ready(metrics)

  return {"bytes": bytes_of, "run": lambda: run(args),
          "idle": lambda: run(idle_args),
          "collectives": per_place(collectives(compiled.as_text(), mesh)),
          "replicated": pipe.replicated_leaves,
          "slots": pipe.placement.num_slots,
          "ticks": int(kind.shape[0]) + 1,  # + the closing tick
          "busy": float(np.mean(kind != program_lib.IDLE)),
          "gradient": float(np.mean(np.isin(kind, gradient))),
          "dtypes": len(state.ring[0].params)}


def as_designed(run: dict, base: dict, F: int, stage_bytes: int) -> bool:
  """Whether a run's collectives are the design's: in the tick, outside any
  conditional, per slot and dtype one all-gather over 'fsdp' of a whole
  stage's bytes and one reduce-scatter of its 1/F, besides the F = 1 run's
  ops; under a conditional, as many of each op as the F = 1 run, none over
  'fsdp'; outside the loop, as many of each op."""
  n, J = run["slots"] * run["dtypes"], run["slots"]
  got, want = run["collectives"], base["collectives"]
  tick, cond = got["tick"], got["tick, under a conditional"]
  return (_counts(tick) == {**_counts(want["tick"]),
                            "all-gather": {"fsdp": n},
                            "reduce-scatter": {"fsdp": n}}
          and tick["all-gather"]["fsdp"][1] == J * stage_bytes
          and tick["reduce-scatter"]["fsdp"][1] == J * stage_bytes // F
          and not any("fsdp" in ops for ops in cond.values())
          and all(_totals(got[p]) == _totals(want[p]) for p in PLACES[::2]))


def _counts(ops: dict) -> dict:
  """`{op: {axes: count}}` of one place's `per_place` entry."""
  return {op: {axes: n for axes, (n, _) in ops[op].items()}
          for op in COLLECTIVES}


def _totals(ops: dict) -> list[int]:
  """How many of each op one place's `per_place` entry holds."""
  return [sum(n for n, _ in ops[op].values()) for op in COLLECTIVES]


def _cell(v) -> str:
  if isinstance(v, int):
    return f"{v:,}"
  return f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(header: list[str], rows: list[list]) -> str:
  return "\n".join(["| " + " | ".join(header) + " |",
                    "|" + "---|" * len(header)]
                   + ["| " + " | ".join(_cell(v) for v in row) + " |"
                      for row in rows])


def memory_table(runs: dict, stage_bytes: int) -> tuple[str, dict]:
  """Per schedule and F: the state's and the compiled step's bytes, the
  total `arguments + temps + (outputs - aliased)`, the aim, and ratios to
  F = 1."""
  def weights(b):
    return b["ring"] + b["opt"] + b["grads"]

  def total(b):
    return b["arguments"] + b["temps"] + b["outputs"] - b["aliased"]

  rows, out = [], {}
  for (name, F), run in runs.items():
    b, base = run["bytes"], runs[name, 1]["bytes"]
    aim = weights(base) // F + (run["slots"] * stage_bytes if F > 1 else 0)
    out[f"{name} F={F}"] = {
        **b, "weights": weights(b), "total": total(b), "aim": aim,
        "weights_over_f1": weights(b) / weights(base),
        "total_over_f1": total(b) / total(base),
        "temps_over_f1": b["temps"] / base["temps"]}
    row = out[f"{name} F={F}"]
    rows.append([name, F, b["ring"], b["opt"], b["grads"], b["acts"],
                 b["arguments"], b["outputs"], b["aliased"], b["temps"],
                 row["weights_over_f1"], row["temps_over_f1"], row["total"],
                 row["total_over_f1"], aim, row["total"] / aim])
  header = ["schedule", "F", "ring", "opt", "grads", "acts", "arguments",
            "outputs", "aliased", "temps", "ring+opt+grads / F=1",
            "temps / F=1", "total", "total / F=1", "aim", "total / aim"]
  return markdown(header, rows), out


def collectives_table(runs: dict) -> tuple[str, dict]:
  """Per run and place: each collective's count and result bytes."""
  rows, out = [], {}
  for key, run in runs.items():
    table = run["collectives"]
    out[key] = table
    for where in PLACES:
      if any(table[where].values()):
        rows.append([*key, where] + ["; ".join(
            f"{n} x {axes}: {size:,} B"
            for axes, (n, size) in table[where][op].items()) or "0"
                                       for op in COLLECTIVES])
  header = ["schedule", "F or rule", "where"] + list(COLLECTIVES)
  return markdown(header, rows), out


def main(argv):
  del argv
  H, N, M, B = (common.HIDDEN.value, common.BATCH.value, common.MICRO.value,
                _MINIBATCHES.value)
  sizes = sorted({1} | {int(f) for f in _FSDP.value})
  staged = common.make_model(S, H, common.LAYERS.value)
  stage_bytes = max(sum(np.asarray(v).nbytes for v in jax.tree.leaves(p))
                    for p in staged.stage_params)
  x, y = common.make_batch(B, M, N, H)

  # Memory: the baseline on the 2-axis mesh, then each F.
  runs = {(name, F): build(name, F, staged, x, y, axes=2 if F == 1 else 3)
          for name in _SCHEDULES.value for F in sizes}
  same = {name: build(name, 1, staged, x, y)["bytes"]
          == runs[name, 1]["bytes"] for name in _SCHEDULES.value}
  print(f"3-axis mesh (1, 2, 1) against 2-axis (1, 2), every byte figure "
        f"equal: {same}")
  replicated = {f"{k[0]} F={k[1]}": r["replicated"] for k, r in runs.items()
                if r["replicated"]}
  print(f"leaves held whole: {replicated or 'none'}")
  memory, memory_rows = memory_table(runs, stage_bytes)
  print(f"\nMemory per device, bytes (stage: {stage_bytes:,} B of weights; "
        "total = arguments + temps + outputs - aliased)\n")
  print(memory)

  # Collectives, against the design; rules that gather the whole stage.
  designed = {f"{name} F={F}": as_designed(run, runs[name, 1], F,
                                           stage_bytes)
              for (name, F), run in runs.items() if F > 1}
  other = {}
  if _OTHER_RULES.value and sizes[-1] > 1:
    name = _SCHEDULES.value[0]
    other = {(name, f"F={F}, {rule}"): build(name, F, staged, x, y, rule,
                                             axes=2 if F == 1 else 3)
             for rule in RULES if rule != "adam" for F in (1, sizes[-1])}
  table, counts = collectives_table({**runs, **other})
  print("\nCollectives in the compiled step: count x mesh axes: their "
        "result bytes; the tick is the scan's loop body, compiled once\n")
  print(table)
  print(f"\nas designed: {designed}")

  # Step time: a window and an idle window, interleaved.
  samples = harness.interleave({
      f"{name} F={F}{idle}": run["idle" if idle else "run"]
      for (name, F), run in runs.items() for idle in ("", " idle")})
  seconds = {k: harness.median(v) for k, v in samples.items()}

  def at(name, F, idle=""):
    return seconds[f"{name} F={F}{idle}"]

  speed = [[name, F, 1e3 * at(name, F), at(name, F) / at(name, 1),
            1e3 * at(name, F, " idle") / run["ticks"],
            at(name, F, " idle") / at(name, 1, " idle"), run["busy"],
            run["gradient"]] for (name, F), run in runs.items()]
  print(f"\nStep time, median of {harness.REPEATS.value} interleaved rounds "
        "(the same work at every F)\n")
  print(markdown(["schedule", "F", "ms a window", "time / F=1",
                  "ms an idle tick", "idle / F=1", "slot-ticks with a task",
                  "with a gradient"], speed))
  harness.record("fsdp_memory", {
      "config": common.config("hidden", "layers", "batch", "micro",
                              "minibatches", "fsdp", "schedules", "repeats"),
      "stage_bytes": stage_bytes, "three_axis_f1_same_bytes": same,
      "replicated": replicated, "memory": memory_rows,
      "collectives": {" ".join(str(p) for p in k): v
                      for k, v in counts.items()},
      "collectives_as_designed": designed, "median_s": seconds})


if __name__ == "__main__":
  harness.run(main)
