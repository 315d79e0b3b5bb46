"""Convergence under 1-step staleness: PipeSGD vs. DC vs. WP on digits.

4 data-parallel replicas simulated on one device (vmap over replicas, all-reduce
= mean), a 64-128-128-10 MLP, SGD with momentum 0.9, 3 seeds (vmapped). Methods:
no staleness, PipeSGD (stale_gradients(1)), DC diagonal and full, WP options
1-3, and the asynchronous-pipeline Nesterov method (Ajanthan et al., ICML 2025:
stale gradients into NAdam with beta1 0.99, at lr x NESTEROV_LR_SCALE since it
is Adam-like). Writes a markdown table and docs/figures/optim_convergence.png.

  .venv/bin/python experiments/optim_convergence.py [--steps 400]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import stalepipe as sp

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

REPLICAS, BATCH, MOMENTUM, LAM = 4, 32, 0.9, 0.2
NESTEROV_LR_SCALE = 0.02  # lr 0.05 -> 1e-3, the Adam-like step size
METHODS = ("no staleness", "PipeSGD", "DC diagonal", "DC full", "WP option 1",
           "WP option 2", "WP option 3", "Async Nesterov")


def init_mlp(key, widths=(64, 128, 128, 10)):
  keys = jax.random.split(key, len(widths) - 1)
  return [{"w": jax.random.normal(k, (i, o)) * np.sqrt(2 / i),
           "b": jnp.zeros(o)} for k, i, o in zip(keys, widths[:-1], widths[1:])]


def logits_fn(params, x_BxI):
  for layer in params[:-1]:
    x_BxI = jax.nn.relu(x_BxI @ layer["w"] + layer["b"])
  return x_BxI @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_fn(params, x), y).mean()


def make_optimizer(method, lr):
  """(predict, update, init) with predict(state, params) -> weights to use."""
  sgd = optax.sgd(lr, MOMENTUM)
  if method.startswith("WP"):
    wp = sp.optim.WeightPrediction(sgd, int(method[-1]), num_workers=REPLICAS,
                                   lam=LAM, form="full")
    return wp.predict, wp.update, wp.init
  opt = {
      "no staleness": sgd,
      "PipeSGD": optax.chain(sp.optim.stale_gradients(1), sgd),
      "DC diagonal": optax.chain(sp.optim.stale_gradients(1),
                                 sp.optim.delay_compensation(LAM), sgd),
      "DC full": optax.chain(sp.optim.stale_gradients(1),
                             sp.optim.delay_compensation(LAM, form="full"),
                             sgd),
      "Async Nesterov": optax.chain(
          sp.optim.stale_gradients(1), sp.optim.scale_by_async_nesterov(),
          optax.scale_by_learning_rate(lr * NESTEROV_LR_SCALE)),
  }[method]
  update = lambda g, s, p, local_updates: opt.update(g, s, p)  # pylint: disable=unnecessary-lambda-assignment
  return (lambda s, p: p), update, opt.init


def run(method, lr, seeds, steps, ds):
  predict, update, init = make_optimizer(method, lr)
  x_train, y_train = jnp.asarray(ds.x_train), jnp.asarray(ds.y_train)

  def replica_step(params, state, key):
    idx = jax.random.randint(key, (BATCH,), 0, x_train.shape[0])
    local = jax.grad(loss_fn)(predict(state, params), x_train[idx], y_train[idx])
    synced = jax.lax.pmean(local, "data")
    updates, state = update(synced, state, params, local_updates=local)
    return optax.apply_updates(params, updates), state

  step = jax.vmap(replica_step, axis_name="data")

  def one_seed(seed):
    key = jax.random.key(seed)
    params = init_mlp(key)
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (REPLICAS, *x.shape)),
                          params)
    state = jax.vmap(init)(params)

    def body(carry, key):
      params, state = carry
      return step(params, state, jax.random.split(key, REPLICAS)), None

    keys = jax.random.split(jax.random.fold_in(key, 1), steps)
    (params, _), _ = jax.lax.scan(body, (params, state), keys)
    p0 = jax.tree.map(lambda x: x[0], params)
    acc = (logits_fn(p0, jnp.asarray(ds.x_test)).argmax(-1) ==
           jnp.asarray(ds.y_test)).mean()
    return loss_fn(p0, x_train, y_train), acc

  loss, acc = jax.jit(jax.vmap(one_seed))(jnp.arange(seeds))
  return np.asarray(loss), np.asarray(acc)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.3])
  parser.add_argument("--out", default="docs/figures/optim_convergence.png")
  args = parser.parse_args()
  ds = sp.data.digits()
  results = {}
  for lr in args.lrs:
    for method in METHODS:
      loss, acc = run(method, lr, args.seeds, args.steps, ds)
      results[(lr, method)] = (loss, acc)
  print(f"digits, {REPLICAS} replicas x batch {BATCH}, SGD momentum {MOMENTUM},"
        f" {args.steps} steps, {args.seeds} seeds (mean +- std), lambda {LAM}")
  print("| lr | method | final training loss | test accuracy |")
  print("|---|---|---|---|")
  for (lr, method), (loss, acc) in results.items():
    print(f"| {lr} | {method} | {loss.mean():.4f} +- {loss.std():.4f} | "
          f"{acc.mean():.4f} +- {acc.std():.4f} |")

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  width = 0.8 / len(args.lrs)
  xs = np.arange(len(METHODS))
  for i, lr in enumerate(args.lrs):
    for ax, k in zip(axes, (0, 1)):
      vals = [results[(lr, m)][k] for m in METHODS]
      ax.bar(xs + i * width, [v.mean() for v in vals], width,
             yerr=[v.std() for v in vals], label=f"lr {lr}", capsize=2)
  for ax, title in zip(axes, ("final training loss (log)", "test accuracy")):
    ax.set_xticks(xs + width * (len(args.lrs) - 1) / 2, METHODS, rotation=30,
                  ha="right")
    ax.set_title(title)
    ax.legend()
  axes[0].set_yscale("log")
  axes[1].set_ylim(0.8, 1.0)
  fig.suptitle(f"digits, {REPLICAS} data replicas, 1-step staleness, "
               f"{args.seeds} seeds")
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(json.dumps({f"{lr}|{m}": [v[0].tolist(), v[1].tolist()]
                    for (lr, m), v in results.items()}))


if __name__ == "__main__":
  main()
