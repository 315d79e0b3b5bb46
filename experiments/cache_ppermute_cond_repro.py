"""Does an executable loaded from JAX's persistent compilation cache compute
what a freshly compiled one does, when `ppermute`s sit under `cond`s?

Standalone (stdlib + numpy + jax). For each form, a child process compiles a
small `shard_map` program fresh (no cache hit) and runs it; then it calls
`jax.clear_caches()` and runs the program again REPEATS times, each call
loading the executable from the persistent cache (the cache-hit events are
counted), comparing every output with the fresh one bit for bit. A second
child process (same cache dir) loads it and compares again. A child that
aborts (XLA:CPU's rendezvous check fails) or hangs after its fresh run counts
as a fault.

Prints one line per form, `OK`, `FAULT`, or `?` (the fresh compile itself
failed, or nothing came from the cache), with what each phase saw:

    python experiments/cache_ppermute_cond_repro.py [--forms a,b] [--repeats 3]

(8 CPU devices are forced unless XLA_FLAGS says otherwise.)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

AX = "i"

# The program: the executor's shape, cut down. Each of n devices holds two
# slots (stages 2d and 2d+1 of 2n); a lax.scan over T ticks, each tick:
#   1. the sends: slot 1's forward row moves to the next device
#      (ppermute, +1) and slot 0's backward row to the previous one
#      (ppermute, -1), each under a `cond` or not, as the form says;
#   2. each slot files what arrived into its buffers (dynamic_update_slice
#      at a slot from a table);
#   3. each slot runs its task, a 3-way lax.switch on a per-stage table
#      (idle / forward / backward: so the devices take different branches),
#      which writes the slot's outbox rows, sent in the next tick.
# Knobs (FORMS):
#   fwd, bwd: how each send is made: "plain" (a ppermute outside any branch),
#     "cond" (under a two-way cond, the other branch zeros), "switch" (a
#     two-way lax.switch), "same" (a cond whose both branches send the same
#     ppermute), "off" (no send in that direction: a local copy)
#   pred: the cond's predicate: "replicated" (a row of the tick's table that
#     every device reads alike) or "device" (differs between devices)
#   perm: "partial" (a shift: the edge device sends nothing) | "full" (cyclic)
#   task: "switch" (the 3-way task switch) | "plain" (both tasks computed,
#     no branch)
#   filing: "slot" (a dynamic_update_slice into the slot the table names)
#     | "blend" (every buffer row blended with what arrived, no indexing)
#   psum: "none" | "cond": also a psum over the axis under a cond on a
#     replicated predicate (the executor's update: a replica all-reduce)
#   fwd_row: what the +1 send carries: "outbox" (last tick's row, ready when
#     the tick starts) | "fresh" (that row through a switch on this tick's
#     task, whose branches cost differently: ready at another time on each
#     device)
#   scan: ticks in a lax.scan (else one tick, unrolled T times: no loop)
#   axis: "explicit" | "auto" mesh axis types; check_vma: shard_map's
#   n: devices; T: ticks; W: row width (float32)
BASE = dict(fwd="plain", bwd="cond", pred="replicated", perm="partial",
            task="switch", filing="slot", psum="none", fwd_row="outbox", scan=True, axis="explicit", check_vma=False,
            n=2, T=64, W=256)
FORMS = {
    "base": {},  # one ppermute under a cond, one outside: FAULT
    "both_cond": dict(fwd="cond"),
    "bwd_switch": dict(bwd="switch"),
    "device_pred": dict(pred="device"),
    "full_perm": dict(perm="full"),
    "n4": dict(n=4),
    "auto_axis": dict(axis="auto"),
    "check_vma": dict(check_vma=True),
    "unrolled": dict(scan=False, T=16),
    "only_cond_send": dict(fwd="off"),
    "no_task_switch": dict(task="plain"),
    "small_rows": dict(W=4),
    "no_filing_slots": dict(filing="blend"),
    # what the executor could use instead
    "same_both_branches": dict(bwd="same"),
    "both_plain": dict(bwd="plain"),
    "both_plain_full": dict(bwd="plain", perm="full"),
    "plain_sends_psum_cond": dict(bwd="plain", psum="cond"),
    "plain_sends_fresh_row": dict(bwd="plain", fwd_row="fresh"),
}


def _tables(form):
  import numpy as np  # pylint: disable=g-import-not-at-top
  n, T, C = form["n"], form["T"], 3
  rng = np.random.default_rng(0)
  slots = lambda: np.where(rng.random((T, 2 * n)) < 0.5,  # pylint: disable=unnecessary-lambda-assignment
                           rng.integers(0, C, (T, 2 * n)), -1).astype(np.int32)
  recv_f, recv_b = slots(), slots()
  return dict(task=rng.integers(0, 3, (T, 2 * n)).astype(np.int32),
              at=rng.integers(0, C, (T, 2 * n)).astype(np.int32),
              # where what arrives is filed: last tick's row
              recv_f=np.roll(recv_f, 1, 0), recv_b=np.roll(recv_b, 1, 0))


def build(form):
  """The jitted program and its input for `form`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  n, W, C = form["n"], form["W"], 3
  tables = _tables(form)
  mesh = jax.make_mesh(
      (n,), (AX,), devices=jax.devices()[:n],
      axis_types=(AxisType.Explicit if form["axis"] == "explicit"
                  else AxisType.Auto,))
  up = [(d, d + 1) for d in range(n - 1)]
  down = [(d + 1, d) for d in range(n - 1)]
  if form["perm"] == "full":
    up, down = up + [(n - 1, 0)], down + [(0, n - 1)]

  def send(how, pred, x, perm):
    move = lambda v: jax.lax.ppermute(v, AX, perm)  # pylint: disable=unnecessary-lambda-assignment
    # (with check_vma, zeros must be device-varying, as the ppermute is)
    zeros = (lambda v: v * 0) if form["check_vma"] else jnp.zeros_like  # pylint: disable=unnecessary-lambda-assignment
    if how == "plain":
      return move(x)
    if how == "off":
      return x
    if how == "cond":
      return jax.lax.cond(pred, move, zeros, x)
    if how == "same":
      return jax.lax.cond(pred, move, move, x)
    return jax.lax.switch(pred.astype(jnp.int32), [zeros, move], x)

  def body(x):
    dev = jax.lax.axis_index(AX)
    stages = [2 * dev, 2 * dev + 1]  # of the device's two slots

    def tick(slots, row):
      rf, rb, task, at = row["recv_f"], row["recv_b"], row["task"], row["at"]
      # does a receiver (slots 0 for the forward send, slots 1 for the
      # backward one) file anything: on all of them, or on this device's?
      if form["pred"] == "replicated":
        pf = jnp.any(rf[np.array([2])] >= 0)  # device 1 slot 0 files
        pb = jnp.any(rb[np.array([1])] >= 0)  # device 0 slot 1 files
      else:
        pf, pb = rf[stages[0]] >= 0, rb[stages[1]] >= 0
      row = slots[1]["out_f"]
      if form["fwd_row"] == "fresh":
        row = jax.lax.switch(task[stages[1]], [
            lambda v: v, lambda v: jnp.tanh(v) * 0.9,
            lambda v: v + 1e-3 * jnp.tanh(jnp.outer(v, v)).sum(0)], row)
      arrived_f = [send(form["fwd"], pf, row, up),
                   slots[0]["out_f"]]
      arrived_b = [slots[1]["out_b"],
                   send(form["bwd"], pb, slots[0]["out_b"], down)]
      if form["psum"] == "cond":  # e.g. an update's gradient all-reduce
        arrived_b[0] = arrived_b[0] + jax.lax.cond(
            pb, lambda v: jax.lax.psum(v, AX), lambda v: v * 0,
            slots[0]["acts"][0])
      new = []
      for j, slot in enumerate(slots):
        s = stages[j]
        if form["filing"] == "slot":
          acts = slot["acts"].at[jnp.where(rf[s] >= 0, rf[s], C)].set(
              arrived_f[j])
          cots = slot["cots"].at[jnp.where(rb[s] >= 0, rb[s], C)].set(
              arrived_b[j])
        else:  # every buffer row takes in what arrived
          acts = slot["acts"] * 0.5 + arrived_f[j]
          cots = slot["cots"] * 0.5 + arrived_b[j]
        a = at[s]
        forward = lambda o, a=a, j=j: (jnp.tanh(acts[a] * (1.5 + j)), o[1])  # pylint: disable=unnecessary-lambda-assignment
        backward = lambda o, a=a: (o[0], cots[a] * 0.5 + acts[a])  # pylint: disable=unnecessary-lambda-assignment
        outs = (slot["out_f"], slot["out_b"])
        if form["task"] == "switch":
          out_f, out_b = jax.lax.switch(task[s], [lambda o: o, forward,
                                                  backward], outs)
        else:
          out_f, out_b = forward(outs)[0], backward(outs)[1]
        new.append(dict(acts=acts, cots=cots, out_f=out_f, out_b=out_b))
      return new, jnp.stack([v["out_f"] + 10 * v["out_b"] for v in new])

    zero = x[0] * 0 if form["check_vma"] else jnp.zeros(W)  # (varying)
    init = [dict(acts=jnp.zeros((C + 1, W)) + x[0],
                 cots=jnp.zeros((C + 1, W)) - x[0], out_f=zero, out_b=zero)
            for j in range(2)]
    if form["scan"]:
      slots, out = jax.lax.scan(tick, init, tables)
    else:
      slots, outs = init, []
      for t in range(form["T"]):
        slots, o = tick(slots, {k: jnp.asarray(v[t]) for k, v in tables.items()})
        outs.append(o)
      out = jnp.stack(outs)
    return jnp.concatenate([out.reshape(-1), slots[0]["acts"].reshape(-1),
                            slots[1]["cots"].reshape(-1)])[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX),
                            out_specs=P(AX), check_vma=form["check_vma"]))
  x = jax.device_put(
      np.linspace(-1, 1, n * W, dtype=np.float32).reshape(n, W),
      NamedSharding(mesh, P(AX)))
  return f, x


def child(args):
  """One phase of one form in this process; prints a JSON line."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **_: hits.append(event))
  count = lambda: hits.count("/jax/compilation_cache/cache_hits")  # pylint: disable=unnecessary-lambda-assignment
  jax.config.update("jax_compilation_cache_dir", args.cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  form = {**BASE, **FORMS[args.child]}
  fresh_path = os.path.join(args.cache_dir, args.child + ".npy")
  result = {}
  if args.phase == "fresh":
    f, x = build(form)
    fresh = np.asarray(f(x))
    result["fresh_hits"] = count()
    np.save(fresh_path, fresh)
    print(json.dumps(dict(result, fresh_done=True)), flush=True)
    jax.clear_caches()
  else:
    fresh = np.load(fresh_path)
  h0, differ = count(), 0
  for _ in range(args.repeats):
    jax.clear_caches()
    f, x = build(form)  # a new jit: served from the persistent cache
    differ += not np.array_equal(np.asarray(f(x)), fresh)
  result.update(hits=count() - h0, differ=differ, runs=args.repeats)
  print(json.dumps(result), flush=True)


def phase(name, which, cache_dir, repeats, timeout):
  """Runs one phase in a child process: its result, or why none came."""
  try:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, "--phase", which,
         "--cache_dir", cache_dir, "--repeats", str(repeats)],
        capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    return {"error": f"hung (killed after {timeout} s)",
            "fresh_done": "fresh_done" in out}
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines or "fresh_done" in lines[-1]:
    why = [l for l in proc.stderr.splitlines() if "Check failed" in l]
    return {"error": f"aborted ({proc.returncode})" +
                     (f": {why[0].split('] ', 1)[-1][:60]}" if why else ""),
            "fresh_done": any("fresh_done" in l for l in lines)}
  return json.loads(lines[-1])


def which_fresh(res):
  """Whether a failed fresh phase failed before its fresh run ended."""
  return res.get("phase") == "fresh" and not res.get("fresh_done")


def verdict(res):
  if "error" in res:
    if which_fresh(res):
      return None, "the fresh compile itself " + res["error"]
    return True, res["error"]
  if res.get("fresh_hits"):
    return None, "the fresh run hit the cache"
  if not res["hits"]:
    return None, "not loaded from the cache"
  return bool(res["differ"]), (f"{res['differ']}/{res['runs']} loaded runs "
                               f"differ ({res['hits']} cache hits)")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--forms", default=",".join(FORMS))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--timeout", type=int, default=30)
  parser.add_argument("--child")
  parser.add_argument("--phase", choices=("fresh", "load"))
  parser.add_argument("--cache_dir")
  args = parser.parse_args()
  if args.child:
    child(args)
    return
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"backend {jax.default_backend()}", flush=True)
  for name in args.forms.split(","):
    with tempfile.TemporaryDirectory() as cache_dir:
      notes, faults = [], []
      for which, label in (("fresh", "same process"),
                           ("load", "new process")):
        res = phase(name, which, cache_dir, args.repeats, args.timeout)
        res["phase"] = which
        bad, note = verdict(res)
        faults.append(bad)
        notes.append(f"{label}: {note}")
        if which == "fresh" and bad is None:
          break
    word = ("FAULT" if any(faults) else
            "?" if None in faults else "OK")
    print(f"{word:5s} {name:19s} " + "; ".join(notes), flush=True)


if __name__ == "__main__":
  main()
