"""A multilayer perceptron as a sequence of blocks."""

import jax
from flax import nnx


class DenseBlock(nnx.Module):
  """Flattens [b, ...] to [b, d_in], then `relu(x W + b)` (bare for logits)."""

  def __init__(self, in_features: int, out_features: int, *, activate: bool,
               rngs: nnx.Rngs):
    self.linear = nnx.Linear(in_features, out_features, rngs=rngs)
    self.activate = activate

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.linear(x.reshape(x.shape[0], -1))
    return nnx.relu(y) if self.activate else y


def mlp(in_features: int, hidden: int, num_hidden_layers: int,
        num_classes: int, *, seed: int = 0) -> list[nnx.Module]:
  """An MLP classifier: `num_hidden_layers` ReLU blocks, then a logits block.

  Args:
    in_features: input width.
    hidden: hidden width.
    num_hidden_layers: ReLU blocks before the output block.
    num_classes: output width (logits).
    seed: parameter initialisation seed.

  Returns:
    `num_hidden_layers + 1` blocks.
  """
  rngs = nnx.Rngs(seed)
  widths = [in_features] + [hidden] * num_hidden_layers
  blocks = [DenseBlock(a, b, activate=True, rngs=rngs)
            for a, b in zip(widths[:-1], widths[1:])]
  blocks.append(DenseBlock(widths[-1], num_classes, activate=False, rngs=rngs))
  return blocks
