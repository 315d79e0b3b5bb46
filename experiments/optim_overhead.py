"""Overhead of staleness compensation in a full jitted training step.

Times, in one run and interleaved, a jitted SGD-momentum training step
(forward + backward + update, params and state donated) of a >= 10M-parameter
MLP without compensation and with: the stale buffer alone (PipeSGD), stale
buffer + DC (diagonal, full), stale buffer + WP (options 1, 3). Reports the
share of the step spent on compensation, (t - t_base) / t per round against
that round's baseline (median and quartiles over rounds), and the
optimizer-state bytes per parameter of every transform in `stalepipe.optim`.

  .venv/bin/python experiments/optim_overhead.py [--batch=64,512,2048] \
      [--repeats=25] [--out_dir=DIR]

Several batch sizes give the share as the step's compute grows: compensation
is a few memory-bound passes over the parameters, a fixed cost per step.
"""

import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import stalepipe as sp

_BATCH = flags.DEFINE_list("batch", ["256"], "Batch sizes, comma-separated.")
_WIDTH = flags.DEFINE_integer("width", 2048, "Width of the MLP's 4 hidden "
                              "layers.")
flags.register_validator("batch", lambda v: all(b.isdigit() and int(b) > 0
                                                for b in v),
                         "--batch: positive integers, comma-separated")
# Its own rounds (a new order each round, shares paired per round).
flags.FLAGS.set_default("repeats", 15)


def mlp_params(key, widths):
  keys = jax.random.split(key, len(widths) - 1)
  return [{"w": jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
           "b": jnp.zeros((o,), jnp.float32)}
          for k, i, o in zip(keys, widths[:-1], widths[1:])]


def loss_fn(params, x_BxI, y_B):
  for layer in params[:-1]:
    x_BxI = jax.nn.relu(x_BxI @ layer["w"] + layer["b"])
  logits_BxC = x_BxI @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, y_B).mean()


def plain_step(opt):
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return opt.init, step


def wp_step(wp):
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(wp.predict(state, params), x, y)
    updates, state = wp.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return wp.init, step


def state_bytes_per_param(transform_init, params):
  num = sum(x.size for x in jax.tree.leaves(params))
  state = jax.eval_shape(transform_init, params)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / num


def time_variants(variants, params, widths, batch, repeats):
  """Median step seconds of every variant, interleaved, and its share."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, widths[0])), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
  runs = {}
  for name, (init, step) in variants.items():
    p = jax.tree.map(jnp.copy, params)
    fn = jax.jit(step, donate_argnums=(0, 1))
    runs[name] = [fn, p, init(p)]
    for _ in range(2):  # compile + warm-up
      runs[name][1], runs[name][2] = fn(*runs[name][1:], x, y)
    jax.block_until_ready(runs[name][1])
  times = {name: [] for name in variants}
  order = list(runs)
  for _ in range(repeats):  # interleaved, so load drifts hit all alike
    rng.shuffle(order)  # and in a new order each round: no position bias
    for name in order:
      run = runs[name]
      start = time.perf_counter()
      run[1], run[2] = run[0](run[1], run[2], x, y)
      jax.block_until_ready(run[1])
      times[name].append(time.perf_counter() - start)
  # Share per round against the same round's baseline (pairing cancels slow
  # drifts of the machine), then the median and quartiles over rounds.
  base = np.asarray(times["baseline (sgd momentum)"])
  out = {}
  for name, ts in times.items():
    shares = (np.asarray(ts) - base) / np.asarray(ts)
    q1, med, q3 = np.percentile(shares, [25, 50, 75])
    out[name] = {"median_s": float(np.median(ts)), "share": float(med),
                 "share_q1": float(q1), "share_q3": float(q3)}
  return out


def main(argv):
  del argv
  batches, repeats = [int(b) for b in _BATCH.value], harness.REPEATS.value
  widths = [1024] + [_WIDTH.value] * 4 + [10]
  params = mlp_params(jax.random.key(0), widths)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  sgd = lambda: optax.sgd(0.01, 0.9)  # pylint: disable=unnecessary-lambda-assignment
  variants = {
      "baseline (sgd momentum)": plain_step(sgd()),
      "stale only (PipeSGD)": plain_step(optax.chain(
          sp.optim.stale_gradients(1), sgd())),
      "stale + DC diagonal": plain_step(optax.chain(
          sp.optim.stale_gradients(1), sp.optim.delay_compensation(0.2),
          sgd())),
      "stale + DC full": plain_step(optax.chain(
          sp.optim.stale_gradients(1),
          sp.optim.delay_compensation(0.2, form="full"), sgd())),
      "stale + WP option 1": wp_step(sp.optim.WeightPrediction(sgd(), 1)),
      "stale + WP option 3": wp_step(sp.optim.WeightPrediction(
          sgd(), 3, num_workers=4)),
  }
  results = {batch: time_variants(variants, params, widths, batch, repeats)
             for batch in batches}
  print(f"MLP {widths}: {num_params / 1e6:.1f}M params, {repeats} "
        f"interleaved repeats, {jax.devices()[0].platform}")
  print("| step | " + " | ".join(f"batch {b}: median ms, share"
                                  for b in batches) + " |")
  print("|---|" + "---|" * len(batches))
  for name in variants:
    cells = []
    for batch in batches:
      r = results[batch][name]
      share = ("-" if name.startswith("baseline") else
               f"{100 * r['share']:.1f}% [{100 * r['share_q1']:.1f}, "
               f"{100 * r['share_q3']:.1f}]")
      cells.append(f"{1e3 * r['median_s']:.1f}, {share}")
    print(f"| {name} | " + " | ".join(cells) + " |")

  transforms = {
      "stale_gradients(1)": sp.optim.stale_gradients(1).init,
      "delay_compensation diagonal/full (delay=1)":
          sp.optim.delay_compensation(0.2).init,
      "delay_compensation(adaptive='ema')":
          sp.optim.delay_compensation(0.2, adaptive="ema").init,
      "delay_compensation(delay=0), stale_params given":
          sp.optim.delay_compensation(0.2, delay=0).init,
      "WeightPrediction option 1 (incl. its stale buffer)":
          sp.optim.WeightPrediction(optax.identity(), 1).init,
      "WeightPrediction option 2 (incl. its stale buffer)":
          sp.optim.WeightPrediction(optax.identity(), 2).init,
      "WeightPrediction option 3 (incl. its stale buffer)":
          sp.optim.WeightPrediction(optax.identity(), 3).init,
      "wave_accumulation": sp.optim.wave_accumulation(4).init,
      "scale_by_staleness": sp.optim.scale_by_staleness(2).init,
      "scale_by_variance_reduced_adam": (
          sp.optim.scale_by_variance_reduced_adam(4).init),
      "reference: optax.scale_by_adam": optax.scale_by_adam().init,
      "reference: optax.sgd(momentum=0.9)": optax.sgd(0.1, 0.9).init,
  }
  print("\n| transform (float32 params) | state bytes / param |")
  print("|---|---|")
  memory = {}
  for name, init in transforms.items():
    memory[name] = state_bytes_per_param(init, params)
    print(f"| {name} | {memory[name]:.2f} |")
  harness.record("optim_overhead", {"params": num_params, "steps": results,
                                    "bytes_per_param": memory})


if __name__ == "__main__":
  harness.run(main)
