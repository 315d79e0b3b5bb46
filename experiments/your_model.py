"""Your own Flax NNX model in a pipeline: a complete example to copy.

An ordinary NNX Transformer LM (embedding, positional table, pre-LN blocks
with dropout, final norm, head) is cut into stages by code (`sp.models.cut`),
trained by the shard_map executor with a global-norm-clipped optimizer on
1F1B, checked against the sequential oracle, and merged back into the module
(`sp.models.merge`) for evaluation in plain Flax. Between stages travels a
pytree: the bfloat16 hidden state, the float attention mask and the int32
token ids (each in its own dtype, never cast). Stage 1 also holds a
BatchNorm (its running statistics are the stage's state, carried by the
pipeline and merged back), every middle stage adds an auxiliary loss on its
activations' size, and the loss function reports the token accuracy, a
metric `step` returns.

  PYTHONPATH=. .venv/bin/python experiments/your_model.py [--schedule 1f1b]

docs/your_model.md walks through it.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import stalepipe as sp

_SCHEDULE = flags.DEFINE_string("schedule", "1f1b", "a flush schedule")
_WINDOWS = flags.DEFINE_integer("windows", 3, "windows to train")

VOCAB, LENGTH, WIDTH = 512, 8, 32
AUX = 0.01  # weight of the middle stages' auxiliary loss


class Block(nnx.Module):
  """Pre-LN causal self-attention + MLP, with dropout on the residuals."""

  def __init__(self, d: int, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d,
                                                                   rngs=rngs)
    self.attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(
        4 * d, d, rngs=rngs)

  def __call__(self, h, mask, *, key, train: bool):
    drop = lambda y, k: (jnp.where(jax.random.bernoulli(k, 0.9, y.shape),  # pylint: disable=unnecessary-lambda-assignment
                                   y / 0.9, 0) if train else y)
    k1, k2 = jax.random.split(key)
    causal = nnx.make_causal_mask(mask) * nnx.make_attention_mask(mask, mask)
    h = h + drop(self.attn(self.ln1(h), mask=causal), k1)
    return h + drop(self.fc2(nnx.gelu(self.fc1(self.ln2(h)))), k2)


class LM(nnx.Module):
  """A GPT-style LM written as a normal module."""

  def __init__(self, layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(),
                                                  (LENGTH, WIDTH)))
    self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)  # on stage 1's output
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)


def first(m: LM, ids, *, key, train):
  """Stage 0: the glue (embedding + positions) and block 0."""
  mask = (ids > 0).astype(jnp.float32)
  h = m.blocks[0](m.embed(ids) + m.pos[:ids.shape[1]], mask, key=key,
                  train=train)
  return {"h": h.astype(jnp.bfloat16), "mask": mask, "ids": ids}


def middle(i: int):
  """Stage i: block i, passing the mask and ids along, with an auxiliary
  loss on the activations' mean square (and stage 1 a BatchNorm)."""
  def stage(m: LM, x, *, key, train):
    h = m.blocks[i](x["h"].astype(jnp.float32), x["mask"], key=key,
                    train=train)
    if i == 1:
      h = m.bn(h, use_running_average=not train)
    return sp.pipeline.stage.Output({**x, "h": h.astype(jnp.bfloat16)},
                                    loss=AUX * jnp.mean(h ** 2))
  return stage


def last(m: LM, x, *, key, train):
  """The last stage: the last block, the final norm and the head."""
  h = m.blocks[len(m.blocks) - 1](x["h"].astype(jnp.float32), x["mask"],
                                  key=key, train=train)
  return m.head(m.ln_f(h))


def loss_fn(logits, targets):
  """Next-token cross-entropy, and the token accuracy as a metric."""
  accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean(), {"accuracy": accuracy}


def build(num_stages: int, seed: int = 0):
  """The module and its stages: one block per stage."""
  model = LM(num_stages, nnx.Rngs(seed))
  stages = [first] + [middle(i) for i in range(1, num_stages - 1)] + [last]
  example = jax.ShapeDtypeStruct((2, LENGTH), jnp.int32)
  return model, sp.models.cut(model, stages, example)


def windows(num, B, M, n, seed=0):
  """Token windows `[B, M, n, LENGTH]` and their next tokens."""
  rng = np.random.default_rng(seed)
  for _ in range(num):
    ids = rng.integers(1, VOCAB, size=(B, M, n, LENGTH + 1)).astype(np.int32)
    yield ids[..., :-1], ids[..., 1:]


def main(argv):
  del argv
  S, M, B, D = 4, 2, 2, 2
  model, staged = build(S)
  schedule = sp.schedules.make(_SCHEDULE.value, num_stages=S,
                               num_microbatches=M, num_minibatches=B)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  mesh = jax.make_mesh((D, S), ("data", "stage"))
  pipe = sp.pipeline.Pipeline(staged.stage_fns, loss_fn, schedule, optimizer,
                              mesh, seed=0)
  oracle = sp.pipeline.reference.Pipeline(staged.stage_fns, loss_fn, schedule,
                                          optimizer, num_replicas=D, seed=0)
  print(f"optimizer scope: {pipe.optimizer_scope}")
  state = pipe.init(staged.stage_params, staged.stage_states)
  ostate = oracle.init(staged.stage_params, staged.stage_states)
  for x, y in windows(_WINDOWS.value, B, M, 2 * D):
    state, metrics = pipe.step(state, x, y)
    ostate, _ = oracle.step(ostate, x, y)
    print(f"loss {float(metrics['loss']):.4f}  "
          f"accuracy {float(metrics['accuracy']):.4f}  "
          f"{metrics['tokens_per_s']:.0f} tokens/s")
  gap = max(float(np.max(np.abs(np.asarray(a, np.float32) - b)))
            for a, b in zip(jax.tree.leaves(pipe.params(state)),
                            jax.tree.leaves(oracle.params(ostate))))
  print(f"executor vs oracle, largest weight difference: {gap:.2e}")
  sp.models.merge(model, pipe.params(state), pipe.stage_states(state))
  x, y = next(windows(1, 1, 1, 4, seed=9))
  h = first(model, x[0, 0], key=jax.random.key(0), train=False)
  for i in range(1, S - 1):
    h = middle(i)(model, h, key=jax.random.key(0), train=False).value
  logits = last(model, h, key=jax.random.key(0), train=False)
  print(f"merged model, eval loss: {float(loss_fn(logits, y[0, 0])[0]):.4f}")


if __name__ == "__main__":
  app.run(main)
