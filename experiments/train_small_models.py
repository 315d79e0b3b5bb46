"""Each small model learns its data set, trained through its stage functions.

For every (model, data set) pair: build the blocks, cut them into 4 stages
with `stalepipe.models.split`, and train the composition of the stage
functions (`unpipelined`) with plain `optax.adam` on the stage parameters,
with the matching loss from `stalepipe.models.losses`. No pipeline schedule
is involved: this checks that models, data and losses fit together and learn.
It reports the first and last training loss, the test metric, the reference
it should beat (chance accuracy; for characters the unigram entropy of the
training text) and the wall time. Run on CPU:

  .venv/bin/python experiments/train_small_models.py [--steps 300]

It prints a Markdown table and writes docs/figures/models_data_curves.png.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

import stalepipe as sp  # pylint: disable=g-import-not-at-top

NUM_STAGES = 4


def digits_images():
  ds = sp.data.digits()
  return ds._replace(x_train=ds.x_train.reshape(-1, 8, 8, 1),
                     x_test=ds.x_test.reshape(-1, 8, 8, 1))


def unigram_bits(tokens: np.ndarray) -> float:
  p = np.bincount(tokens.ravel()) / tokens.size
  p = p[p > 0]
  return float(-(p * np.log2(p)).sum())


# name, data, model kwargs, loss, batch size, learning rate.
RUNS = [
    ("mlp / synthetic", lambda: sp.data.synthetic(4096, 1024),
     dict(name="mlp", in_features=32, hidden=128, num_hidden_layers=3,
          num_classes=10), sp.models.losses.cross_entropy, 64, 1e-3),
    ("vgg / digits", digits_images,
     dict(name="vgg", num_classes=10, image_size=8, in_channels=1,
          stages=((16, 16), (32, 32)), dense=(64,)),
     sp.models.losses.cross_entropy, 64, 1e-3),
    ("resnet / digits", digits_images,
     dict(name="resnet", num_classes=10, in_channels=1, stem_width=16,
          widths=(16, 32), depths=(1, 1)),
     sp.models.losses.cross_entropy, 64, 1e-3),
    ("transformer / chars", lambda: sp.data.chars(64),
     dict(name="transformer", vocab_size=sp.data.chars_vocab().size,
          d_model=64, num_heads=4, num_layers=2, max_len=64),
     sp.models.losses.lm_cross_entropy, 32, 3e-3),
]


def train(ds, model_kwargs, loss_fn, batch_size, lr, steps, seed=0):
  """Returns per-step training losses, the test loss and the test accuracy."""
  kwargs = dict(model_kwargs)
  staged = sp.models.split(sp.models.make(kwargs.pop("name"), **kwargs),
                           NUM_STAGES)
  model_fn = sp.models.unpipelined(staged)
  optimizer = optax.adam(lr)
  params = staged.stage_params
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(model_fn(p, x), y))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    idx = rng.integers(0, len(ds.x_train), batch_size)
    params, opt_state, loss = step(params, opt_state, ds.x_train[idx],
                                   ds.y_train[idx])
    losses.append(float(loss))
  logits = jax.jit(model_fn)(params, ds.x_test)
  test_loss = float(loss_fn(logits, ds.y_test))
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == ds.y_test))
  return np.array(losses), test_loss, accuracy


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  print(f"| model / data | params | steps | first -> last train loss | "
        "test | reference | seconds |")
  print("|---|---:|---:|---|---|---|---:|")
  curves = {}
  for name, load, model_kwargs, loss_fn, batch, lr in RUNS:
    ds = load()
    start = time.perf_counter()
    losses, test_loss, accuracy = train(ds, model_kwargs, loss_fn, batch, lr,
                                        args.steps)
    seconds = time.perf_counter() - start
    kwargs = dict(model_kwargs)
    num_params = sum(x.size for x in jax.tree.leaves(sp.models.split(
        sp.models.make(kwargs.pop("name"), **kwargs), 1).stage_params))
    if loss_fn is sp.models.losses.lm_cross_entropy:
      test = f"{test_loss / np.log(2):.2f} bits/char"
      reference = f"unigram {unigram_bits(ds.y_train):.2f} bits/char"
    else:
      test = f"accuracy {accuracy:.3f}"
      reference = (f"majority class "
                   f"{np.bincount(ds.y_test).max() / len(ds.y_test):.3f}")
    print(f"| {name} | {num_params:,} | {args.steps} | "
          f"{losses[:10].mean():.3f} -> {losses[-20:].mean():.3f} | {test} | "
          f"{reference} | {seconds:.1f} |")
    curves[name] = losses

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name, losses in curves.items():
    smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
    ax.plot(smooth, label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (10-step mean)")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig("docs/figures/models_data_curves.png", dpi=120)


if __name__ == "__main__":
  main()
