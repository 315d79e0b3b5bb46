"""A VGG-style convolutional network as a sequence of blocks.

Each convolutional block is a run of 3x3 'SAME' convolutions with ReLU closed
by a 2x2 max pool (one VGG "stage"); the dense blocks that follow flatten the
feature map and end in a logits block. There is no normalisation, as in the
original VGG, so every block is a pure function of its parameters.

References:
  Simonyan & Zisserman, Very Deep Convolutional Networks for Large-Scale Image
  Recognition <https://arxiv.org/abs/1409.1556>, 2015 (Table 1, configs A-E).
"""

from typing import Sequence

import jax
from flax import nnx

from stalepipe.models.mlp import DenseBlock

# Table 1 of Simonyan & Zisserman: conv widths per stage, each stage pooled.
VGG16 = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512),
         (512, 512, 512))
VGG19 = ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)


class ConvBlock(nnx.Module):
  """3x3 conv-ReLUs then a 2x2 max pool: [b, h, w, c] -> [b, h/2, w/2, c']."""

  def __init__(self, in_channels: int, widths: Sequence[int], *,
               rngs: nnx.Rngs):
    channels = [in_channels, *widths]
    self.convs = nnx.List([nnx.Conv(a, b, (3, 3), rngs=rngs)
                           for a, b in zip(channels[:-1], channels[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    for conv in self.convs:
      x = nnx.relu(conv(x))
    return nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))


def vgg(num_classes: int = 10, *, image_size: int = 32, in_channels: int = 3,
        stages: Sequence[Sequence[int]] = ((32, 32), (64, 64)),
        dense: Sequence[int] = (128,), seed: int = 0) -> list[nnx.Module]:
  """A VGG classifier on NHWC images `[b, image_size, image_size, in_channels]`.

  Blocks: one `ConvBlock` per entry of `stages` (each halves the spatial size,
  flooring), one ReLU `DenseBlock` per entry of `dense`, and a logits block
  giving `[b, num_classes]`. With `p = image_size // 2**len(stages)` the
  parameter count is

  .. math::
    \\sum_{\\text{convs}} (9 c_{in} + 1) c_{out}
    + \\sum_{\\text{dense}} (d_{in} + 1) d_{out},
    \\quad d_{in}^{(1)} = p^2 c_{last}.

  `vgg(1000, image_size=224, stages=VGG19, dense=(4096, 4096))` is VGG-19
  (143,667,240 parameters, 548 MiB in float32, the size HetPipe §8.3 quotes).

  Args:
    num_classes: width of the logits.
    image_size: input height and width.
    in_channels: input channels (1 for digits, 3 for CIFAR).
    stages: conv widths of each pooled block.
    dense: widths of the hidden dense blocks.
    seed: parameter initialisation seed.

  Returns:
    `len(stages) + len(dense) + 1` blocks.

  References:
    Simonyan & Zisserman, Very Deep Convolutional Networks for Large-Scale
    Image Recognition <https://arxiv.org/abs/1409.1556>, 2015 (§2.1, Table 1).

  Examples:
    >>> import jax.numpy as jnp
    >>> blocks = vgg(10, image_size=8, in_channels=1, stages=((8, 8),))
    >>> x = jnp.zeros((2, 8, 8, 1))
    >>> for block in blocks:
    ...   x = block(x)
    >>> x.shape
    (2, 10)
  """
  if not stages or any(not widths for widths in stages):
    raise ValueError(f"stages={stages!r} is invalid; valid: a non-empty "
                     "sequence of non-empty width sequences")
  size = image_size // 2**len(stages)
  if size < 1:
    raise ValueError(f"image_size={image_size} is too small for "
                     f"{len(stages)} pooled stages; valid: at least "
                     f"{2**len(stages)}")
  rngs = nnx.Rngs(seed)
  blocks, channels = [], in_channels
  for widths in stages:
    blocks.append(ConvBlock(channels, widths, rngs=rngs))
    channels = widths[-1]
  features = [size * size * channels, *dense]
  blocks += [DenseBlock(a, b, activate=True, rngs=rngs)
             for a, b in zip(features[:-1], features[1:])]
  blocks.append(DenseBlock(features[-1], num_classes, activate=False,
                           rngs=rngs))
  return blocks
