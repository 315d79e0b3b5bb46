"""A residual network as a sequence of blocks: stem, residual blocks, head.

Every residual block is one pipeline block, so a ResNet can be cut between
any two of them. Batch statistics would be state shared across microbatches,
so GroupNorm replaces BatchNorm (Wu & He, 2018); its learnable scale and bias
have the same count as BatchNorm's, so parameter counts match the paper's.

References:
  He et al, Deep Residual Learning for Image Recognition
  <https://arxiv.org/abs/1512.03385>, 2016 (§3.3, §4.2, Table 1).
  Wu & He, Group Normalization <https://arxiv.org/abs/1803.08494>, 2018.
"""

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# Table 1 of He et al: residual blocks per stage.
RESNET18 = (2, 2, 2, 2)
RESNET50 = (3, 4, 6, 3)
RESNET152 = (3, 8, 36, 3)


def _norm(channels: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
  return nnx.GroupNorm(channels, num_groups=math.gcd(32, channels), rngs=rngs)


def _conv(c_in: int, c_out: int, kernel: int, stride: int,
          rngs: nnx.Rngs) -> nnx.Conv:
  # A norm follows every convolution, so a bias would be redundant.
  return nnx.Conv(c_in, c_out, (kernel, kernel), strides=stride,
                  use_bias=False, rngs=rngs)


class Stem(nnx.Module):
  """conv-norm-relu: [b, h, w, c_in] -> [b, h', w', width].

  `imagenet=True` is He et al's 7x7 stride-2 convolution and 3x3 stride-2 max
  pool (h' = h/4); otherwise the 3x3 stride-1 CIFAR stem of §4.2 (h' = h).
  """

  def __init__(self, in_channels: int, width: int, *, imagenet: bool,
               rngs: nnx.Rngs):
    self.conv = _conv(in_channels, width, 7 if imagenet else 3,
                      2 if imagenet else 1, rngs)
    self.norm = _norm(width, rngs)
    self.imagenet = imagenet

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.norm(self.conv(x)))
    if self.imagenet:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    return x


class ResidualBlock(nnx.Module):
  """`relu(F(x) + shortcut(x))`: [b, h, w, c_in] -> [b, h/s, w/s, c_out].

  `F` is two 3x3 conv-norms (basic block) or 1x1, 3x3, 1x1 conv-norms with a
  `c_out / 4` bottleneck, the stride `s` on the 3x3 conv. The shortcut is the
  identity, or a strided 1x1 conv-norm projection when the shape changes
  (option B of §3.3).
  """

  def __init__(self, c_in: int, c_out: int, stride: int, *, bottleneck: bool,
               rngs: nnx.Rngs):
    if bottleneck:
      mid = c_out // 4
      shapes = [(c_in, mid, 1, 1), (mid, mid, 3, stride), (mid, c_out, 1, 1)]
    else:
      shapes = [(c_in, c_out, 3, stride), (c_out, c_out, 3, 1)]
    self.convs = nnx.List([_conv(a, b, k, s, rngs) for a, b, k, s in shapes])
    self.norms = nnx.List([_norm(b, rngs) for _, b, _, _ in shapes])
    if stride != 1 or c_in != c_out:
      self.projection = _conv(c_in, c_out, 1, stride, rngs)
      self.projection_norm = _norm(c_out, rngs)
    else:
      self.projection = self.projection_norm = None

  def __call__(self, x: jax.Array) -> jax.Array:
    shortcut = x
    if self.projection is not None:
      shortcut = self.projection_norm(self.projection(x))
    y = x
    for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
      y = norm(conv(y))
      if i < len(self.convs) - 1:
        y = nnx.relu(y)
    return nnx.relu(y + shortcut)


class Head(nnx.Module):
  """Global average pool then logits: [b, h, w, c] -> [b, num_classes]."""

  def __init__(self, channels: int, num_classes: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(channels, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear(jnp.mean(x, axis=(1, 2)))


def resnet(num_classes: int = 10, *, in_channels: int = 3,
           stem_width: int = 16, widths: Sequence[int] = (16, 32, 64),
           depths: Sequence[int] = (2, 2, 2), bottleneck: bool = False,
           imagenet_stem: bool = False, seed: int = 0) -> list[nnx.Module]:
  """A ResNet classifier on NHWC images `[b, h, w, in_channels]`.

  Blocks: a `Stem`, then for each stage `i` `depths[i]` `ResidualBlock`s of
  output width `widths[i]` (the first strided by 2 for `i > 0`), then a
  `Head`. Convolutions have no bias; each has a norm with `2 c` parameters:

  .. math::
    \\underbrace{k^2 c_{in} w_0 + 2 w_0}_{\\text{stem}}
    + \\sum_{\\text{blocks}} \\sum_{\\text{convs}} (k^2 c_{in} + 2) c_{out}
    + \\underbrace{(c_{last} + 1) n}_{\\text{head}}.

  The default is the 3-stage CIFAR ResNet-14 of §4.2 (`depths=(3, 3, 3)` is
  ResNet-20). `resnet(1000, stem_width=64, widths=(256, 512, 1024, 2048),
  depths=RESNET152, bottleneck=True, imagenet_stem=True)` is ResNet-152
  (60,192,808 parameters, 230 MiB in float32, the size HetPipe §8.3 quotes).

  Args:
    num_classes: width of the logits.
    in_channels: input channels.
    stem_width: output channels of the stem.
    widths: output channels of each stage's blocks.
    depths: residual blocks per stage.
    bottleneck: bottleneck blocks (ResNet-50 and deeper) instead of basic ones.
    imagenet_stem: the 7x7/2 conv and max pool stem instead of a 3x3 conv.
    seed: parameter initialisation seed.

  Returns:
    `sum(depths) + 2` blocks.

  References:
    He et al, Deep Residual Learning for Image Recognition
    <https://arxiv.org/abs/1512.03385>, 2016 (§3.3, §4.2, Table 1).

  Examples:
    >>> import jax.numpy as jnp
    >>> blocks = resnet(10, in_channels=1, depths=(1, 1, 1))
    >>> x = jnp.zeros((2, 8, 8, 1))
    >>> for block in blocks:
    ...   x = block(x)
    >>> len(blocks), x.shape
    (5, (2, 10))
  """
  if len(widths) != len(depths) or not depths or min(depths) < 1:
    raise ValueError(f"widths={tuple(widths)} and depths={tuple(depths)} are "
                     "invalid; valid: equally long, non-empty, depths >= 1")
  if bottleneck and any(w % 4 for w in widths):
    raise ValueError(f"widths={tuple(widths)} are invalid for bottleneck "
                     "blocks; valid: multiples of 4")
  rngs = nnx.Rngs(seed)
  blocks = [Stem(in_channels, stem_width, imagenet=imagenet_stem, rngs=rngs)]
  channels = stem_width
  for i, (width, depth) in enumerate(zip(widths, depths)):
    for j in range(depth):
      stride = 2 if i > 0 and j == 0 else 1
      blocks.append(ResidualBlock(channels, width, stride,
                                  bottleneck=bottleneck, rngs=rngs))
      channels = width
  blocks.append(Head(channels, num_classes, rngs=rngs))
  return blocks
