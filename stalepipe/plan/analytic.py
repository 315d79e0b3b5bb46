"""Analytic block profiles of VGG-19 and ResNet-152 from their layer shapes.

For the HetPipe experiments (seed 001 §8, Tables 3-4) the profiles come from
the published architectures at 224x224 ImageNet input, not from a GPU:

- forward FLOPs of a block: :math:`2 \\cdot` its multiply-adds; backward is
  twice the forward (input and weight gradients);
- seconds: FLOPs over the device's peak FP32 rate (seed 001 Table 1) times an
  `efficiency` (calibrated by the caller, e.g. on seed 001 Table 4's single
  TITAN V throughput);
- bytes: float32; a block's output is its last tensor; it keeps for backward
  its input and, per convolution, the convolution's output (batch norm's
  input) and the ReLU's output where the next layer does not keep it; a
  tensor two blocks share is counted once, in the block that reads it.

VGG-19 is 19 blocks (16 convolutions, pooling folded into the convolution
before it, 3 dense layers; 143.7M parameters, 548 MiB as seed 001 §8.3
says). ResNet-152 is 52 blocks (the stem, 50 bottlenecks with the stride on
the 3x3 convolution, the pooled classifier; 60.2M parameters, 230 MiB).
"""

from typing import NamedTuple

from stalepipe.plan.devices import DeviceType
from stalepipe.plan.profile import Profile

BYTES = 4  # float32


class BlockShape(NamedTuple):
  """One block's work and tensor sizes per input sample."""

  macs: int  # multiply-adds of the forward pass
  params: int  # parameters (weights, biases, normalisation scales/offsets)
  output: int  # elements of the output activation
  kept: int  # elements held from forward to backward


def _conv(size: int, cin: int, cout: int, kernel: int, stride: int = 1):
  out = size // stride
  return out, out * out * cin * cout * kernel * kernel, kernel * kernel * cin * cout


def vgg19() -> list[BlockShape]:
  """VGG-19 (configuration E) at 224x224, one block per weighted layer."""
  plan = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
          512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
  blocks, size, cin = [], 224, 3
  for i, width in enumerate(plan):
    if width == "M":
      continue
    pooled = i + 1 < len(plan) and plan[i + 1] == "M"
    _, macs, weights = _conv(size, cin, width, 3)
    conv_in, conv_out = size * size * cin, size * size * width
    size = size // 2 if pooled else size
    out = size * size * width
    blocks.append(BlockShape(
        macs=macs, params=weights + width, output=out,
        kept=conv_in + conv_out))
    cin = width
  for fan_in, fan_out in ((7 * 7 * 512, 4096), (4096, 4096), (4096, 1000)):
    blocks.append(BlockShape(macs=fan_in * fan_out,
                             params=fan_in * fan_out + fan_out,
                             output=fan_out, kept=fan_in + fan_out))
  return blocks


def _bottleneck(size: int, cin: int, mid: int, stride: int) -> tuple[int, BlockShape]:
  cout = 4 * mid
  _, m1, w1 = _conv(size, cin, mid, 1)
  out, m2, w2 = _conv(size, mid, mid, 3, stride)
  _, m3, w3 = _conv(out, mid, cout, 1)
  macs, weights = m1 + m2 + m3, w1 + w2 + w3
  bn = 2 * (mid + mid + cout)
  # The input, conv and ReLU outputs of the first two convolutions, the
  # third's conv output (batch norm's input); the ReLU after the residual add
  # keeps the block output, which the next block keeps as its input.
  kept = (size * size * cin + 2 * (size * size * mid + out * out * mid)
          + out * out * cout)
  if stride != 1 or cin != cout:
    _, ms, ws = _conv(size, cin, cout, 1, stride)
    macs, weights, bn = macs + ms, weights + ws, bn + 2 * cout
    kept += out * out * cout
  return out, BlockShape(macs=macs, params=weights + bn,
                         output=out * out * cout, kept=kept)


def resnet152() -> list[BlockShape]:
  """ResNet-152 at 224x224: stem, 3-8-36-3 bottlenecks, classifier."""
  size, macs, weights = _conv(224, 3, 64, 7, 2)
  blocks = [BlockShape(macs=macs, params=weights + 2 * 64,
                       output=(size // 2) ** 2 * 64,
                       kept=224 * 224 * 3 + 2 * size * size * 64)]
  size, cin = size // 2, 64
  for depth, mid, stride in ((3, 64, 1), (8, 128, 2), (36, 256, 2),
                             (3, 512, 2)):
    for i in range(depth):
      size, block = _bottleneck(size, cin, mid, stride if i == 0 else 1)
      blocks.append(block)
      cin = 4 * mid
  blocks.append(BlockShape(macs=2048 * 1000, params=2048 * 1000 + 1000,
                           output=1000, kept=size * size * 2048 + 2048))
  return blocks


MODELS = {"vgg19": vgg19, "resnet152": resnet152}


def training_flops(blocks: list[BlockShape]) -> float:
  """Forward plus backward FLOPs per sample: :math:`3 \\cdot 2 \\cdot` MACs."""
  return 6.0 * sum(b.macs for b in blocks)


def profile(blocks: list[BlockShape], device: DeviceType, batch_size: int,
            efficiency: float = 1.0) -> Profile:
  """The profile of `blocks` on `device` at `batch_size`.

  .. math::
    t^{fwd}_j = \\frac{2\\,\\mathrm{MAC}_j \\cdot b}{\\eta \\cdot
    \\mathrm{TFLOPS} \\cdot 10^{12}}, \\qquad t^{bwd}_j = 2\\, t^{fwd}_j

  Args:
    blocks: block shapes (`vgg19()`, `resnet152()`).
    device: the device type (seed 001 Table 1).
    batch_size: :math:`b`, samples per minibatch.
    efficiency: :math:`\\eta`, achieved fraction of peak FP32.

  Returns:
    The profile.

  References:
    Park et al, HetPipe, 2020, §7 and Table 1; Simonyan and Zisserman, Very
    Deep Convolutional Networks <https://arxiv.org/abs/1409.1556>, 2014
    (Table 1, E); He et al, Deep Residual Learning
    <https://arxiv.org/abs/1512.03385>, 2015 (Table 1, 152-layer).

  Examples:
    >>> from stalepipe.plan.devices import TITAN_V
    >>> round(sum(b.params for b in vgg19()) * 4 / 2**20)
    548
    >>> p = profile(vgg19(), TITAN_V, batch_size=32)
    >>> p.num_blocks, p.device
    (19, 'V')
  """
  if batch_size < 1 or efficiency <= 0:
    raise ValueError(f"batch_size={batch_size}, efficiency={efficiency} are "
                     "invalid; valid: batch_size >= 1, efficiency > 0")
  rate = efficiency * device.tflops * 1e12
  forward = tuple(2.0 * b.macs * batch_size / rate for b in blocks)
  return Profile(
      device=device.name, batch_size=batch_size, forward_s=forward,
      backward_s=tuple(2.0 * t for t in forward),
      param_bytes=tuple(BYTES * b.params for b in blocks),
      output_bytes=tuple(BYTES * batch_size * b.output for b in blocks),
      kept_bytes=tuple(BYTES * batch_size * b.kept for b in blocks))
