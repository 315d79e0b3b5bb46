"""A folded pipeline on one device against a plain jitted training step.

One model of `--blocks` blocks `H x H` (`stalepipe.models.mlp`), cut into S
stages for each S of `--stages`, runs `--schedule` with all S stages folded
onto ONE device (`Pipeline(placement="consecutive")` on a 1 x 1 mesh). The
reference is a plain jitted step of the same work: for each of the window's B
minibatches, the mean gradient of the whole model over its M micro-batches
(a `lax.scan` accumulating), then SGD. Both are timed interleaved in one run;
the figure is the ratio executor / plain per S (median of `--repeats`),
which is what folding costs over the work itself: the ticks, the task
dispatch, the buffers. Each schedule of `--schedules` is timed in the same
interleaved rounds.

  python experiments/folding_speed.py --stages=1,2,4,8,16,32 --repeats=5
  taskset -c 0 python experiments/folding_speed.py ...   # one core
  python experiments/folding_speed.py --stages=1,2,4,8,16 \
      --schedules=interleaved-1f1b@slots,interleaved-1f1b@lanes  # tick cost

Results: `folding_speed.json` under `--out_dir` and the figure
`folding_speed.png` (the ratio against S, one line per schedule; into
docs/figures/ with --write_figures), which docs/executor.md quotes.
"""

import executor_common  # pylint: disable=g-bad-import-order,unused-import  (8 CPU devices)

import functools

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor

STAGES = flags.DEFINE_list("stages", ["1", "2", "4", "8", "16", "32"],
                           "Stage counts S (each divides --blocks).")
BLOCKS = flags.DEFINE_integer("blocks", 32, "Blocks of the model, fixed.")
SCHEDULES = flags.DEFINE_list(
    "schedules", ["1f1b", "pipedream"],
    "Schedules to fold; `name@tick` picks the executor's tick (`slots` or "
    "`lanes`, `Pipeline(tick=)`; with one stage there is one slot, and "
    "`lanes` runs the slots' tick).")
REMAT = flags.DEFINE_enum("remat", "residuals", ["residuals", "recompute"],
                          "The executor's remat (recompute adds a forward).")
WINDOW = flags.DEFINE_integer("window", 2, "Minibatches per window, B.")
LAYOUT = flags.DEFINE_enum("layout", "packed", ["packed", "stacked"],
                           "The executor's weight layout (stacked: every "
                           "stage the same structure, read in place).")
LR = 0.01


def plain_step(staged, num_microbatches: int):
  """The jitted plain step: per minibatch, the mean gradient over its
  micro-batches, then SGD, for the window's B minibatches."""
  model = sp.models.unpipelined(staged)
  loss = lambda p, x, y: cross_entropy(model(p, x), y)  # pylint: disable=unnecessary-lambda-assignment

  def minibatch(params, xy):
    def accumulate(total, xy_m):
      value, grads = jax.value_and_grad(loss)(params, *xy_m)
      return jax.tree.map(jnp.add, total, grads), value
    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, values = jax.lax.scan(accumulate, zeros, xy)
    params = jax.tree.map(lambda p, g: p - LR * g / num_microbatches, params,
                          grads)
    return params, values.mean()

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(params, x, y):
    return jax.lax.scan(minibatch, params, (x, y))

  return step


def variants(S: int, x, y) -> dict:
  """For S stages: each schedule's folded executor and the plain step, as
  callables."""
  H, M = flags.FLAGS.hidden, flags.FLAGS.micro
  staged = sp.models.split(sp.models.mlp(H, H, BLOCKS.value - 1, H), S)
  mesh = jax.make_mesh((1, 1), ("data", "stage"), devices=jax.devices()[:1])
  runs = {}
  for name in SCHEDULES.value:
    base, _, tick = name.partition("@")
    schedule = executor_common.make_schedule(base, S, M, WINDOW.value)
    pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                             optax.sgd(LR), mesh, remat=REMAT.value,
                             layout=LAYOUT.value,
                             tick="slots" if S == 1 else tick or "auto")
    runs[f"{name}_S{S}"], _, _ = executor_common.window_runner(
        pipe, staged.stage_params, x, y)
  plain = plain_step(staged, M)
  params = [jax.device_put(tuple(staged.stage_params), jax.devices()[0])]
  xs, ys = jax.device_put((x, y), jax.devices()[0])

  def reference():
    params[0], losses = plain(params[0], xs, ys)
    jax.block_until_ready(losses)

  runs[f"plain_S{S}"] = reference
  return runs


def main(argv):
  del argv
  stages = [int(s) for s in STAGES.value]
  for S in stages:
    if S < 1 or BLOCKS.value % S:
      raise ValueError(f"--stages value {S} is invalid; valid: a divisor of "
                       f"--blocks={BLOCKS.value}")
  H, M = flags.FLAGS.hidden, flags.FLAGS.micro
  x, y = executor_common.make_batch(WINDOW.value, M, flags.FLAGS.batch, H)
  runs = {}
  for S in stages:
    runs.update(variants(S, x, y))
  times = executor_common.interleaved_samples(runs)
  rows = []
  for name in SCHEDULES.value:
    for S in stages:
      folded, plain = times[f"{name}_S{S}"], times[f"plain_S{S}"]
      rows.append({"schedule": name, "stages": S,
                   "folded_s": harness.median(folded),
                   "plain_s": harness.median(plain),
                   "ratio": float(np.median([f / p for f, p in
                                             zip(folded, plain)]))})
      print(f"{name:10s} S={S:3d}  folded {rows[-1]['folded_s'] * 1e3:8.1f} "
            f"ms  plain {rows[-1]['plain_s'] * 1e3:8.1f} ms  ratio "
            f"{rows[-1]['ratio']:.2f}")
  harness.record("folding_speed", {
      "config": executor_common.config("hidden", "batch", "micro", "blocks",
                                       "schedules", "remat", "window",
                                       "layout", "repeats"),
      "rows": rows})
  path = harness.figure_path("folding_speed.png")
  if path:
    plot(rows, path)


def plot(rows: list[dict], path: str) -> None:
  """The ratio folded / plain against S, one line per schedule."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(5, 3.4))
  for name in dict.fromkeys(r["schedule"] for r in rows):
    mine = [r for r in rows if r["schedule"] == name]
    ax.plot([r["stages"] for r in mine], [r["ratio"] for r in mine],
            marker="o", label=name)
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set(xlabel="stages S, all on one device",
         ylabel="folded step / plain jitted step",
         title=f"{BLOCKS.value} blocks {flags.FLAGS.hidden}x"
               f"{flags.FLAGS.hidden}, M={flags.FLAGS.micro}, "
               f"B={WINDOW.value}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  flags.FLAGS.set_default("hidden", 256)
  flags.FLAGS.set_default("batch", 32)
  harness.run(main)
