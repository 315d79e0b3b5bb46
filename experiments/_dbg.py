import executor_common as common
import sys, re, collections
from absl import flags
import jax, optax
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
flags.FLAGS(["x"])
P=4
import os
NAME=os.environ.get("NAME","pipedream"); PL=os.environ.get("PL") or None
x, y = common.make_batch(2, 1, 32, 512)
for stash in ("slots", "pooled"):
  schedule = common.make_schedule(NAME, 2 * P, 1, 2, devices=P)
  staged = common.make_model(2 * P, 512, 2)
  mesh = jax.make_mesh((1, P), ("data", "stage"), devices=jax.devices()[:P])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule, optax.sgd(0.01), mesh, placement=PL, stash=stash)
  state = pipe.init(staged.stage_params)
  state, _ = pipe.step(state, x, y)
  f = pipe.compile(state, x, y)
  txt = f.as_text() if hasattr(f, "as_text") else None
  if txt is None:
    state2, *args = pipe.arguments(state, x, y)
    txt = pipe._step_fn(x, y).lower(state2, *args).compile().as_text()
  open(f"/tmp/hlo_{stash}.txt","w").write(txt)
  copies = collections.Counter(re.findall(r"= (f32\[[0-9,]+\]\{[^}]*\}) copy\(", txt))
  print(stash, sorted(copies.items(), key=lambda kv: -kv[1])[:8])
