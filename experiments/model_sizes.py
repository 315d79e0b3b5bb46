"""Parameter counts of full-size stalepipe models against the papers.

Builds VGG-16/19, ResNet-18/50/152 and a GPT-2-small-shaped Transformer with
`nnx.eval_shape` (nothing is allocated), counts their parameters and float32
MiB, and prints them beside the published figures. For ResNet-152 it also
compares, block by block, the parameters and per-sample output sizes of
`stalepipe.models.resnet` with the planner's analytic profile
(`stalepipe.plan.analytic.resnet152`), which HetPipe's partitioner uses. Run:

  .venv/bin/python experiments/model_sizes.py [--out_dir=DIR]
"""

import jax
import numpy as np
from flax import nnx

import harness
import stalepipe as sp
from stalepipe.models.cnn import VGG16, VGG19
from stalepipe.models.resnet import RESNET18, RESNET50, RESNET152
from stalepipe.plan import analytic

IMAGENET = dict(stem_width=64, imagenet_stem=True)
BOTTLENECK = dict(widths=(256, 512, 1024, 2048), bottleneck=True, **IMAGENET)

# name, constructor, input, published parameter count and its source.
MODELS = [
    ("VGG-16", lambda: sp.models.vgg(1000, image_size=224, stages=VGG16,
                                     dense=(4096, 4096)),
     (1, 224, 224, 3), "138M (Simonyan & Zisserman Table 2)"),
    ("VGG-19", lambda: sp.models.vgg(1000, image_size=224, stages=VGG19,
                                     dense=(4096, 4096)),
     (1, 224, 224, 3), "144M (Simonyan & Zisserman Table 2); 548 MB "
     "(HetPipe §8.3)"),
    ("ResNet-18", lambda: sp.models.resnet(
        1000, widths=(64, 128, 256, 512), depths=RESNET18, **IMAGENET),
     (1, 224, 224, 3), "11.7M (torchvision)"),
    ("ResNet-50", lambda: sp.models.resnet(1000, depths=RESNET50,
                                           **BOTTLENECK),
     (1, 224, 224, 3), "25.6M (torchvision)"),
    ("ResNet-152", lambda: sp.models.resnet(1000, depths=RESNET152,
                                            **BOTTLENECK),
     (1, 224, 224, 3), "60.2M (torchvision); 230 MB (HetPipe §8.3)"),
    ("GPT-2 small, untied head", lambda: sp.models.transformer(
        50257, d_model=768, num_heads=12, num_layers=12, max_len=1024),
     None, "124,439,808 tied (Radford et al: '117M') + (768+1) x 50257"),
]


def block_params(blocks) -> list[int]:
  return [sum(int(np.prod(p.shape))
              for p in jax.tree.leaves(nnx.state(b, nnx.Param)))
          for b in blocks]


def block_outputs(blocks, shape) -> list[int]:
  """Elements of each block's output for one sample of input `shape`."""
  x, sizes = jax.ShapeDtypeStruct(shape, np.float32), []
  for block in blocks:
    x = nnx.eval_shape(lambda b, x: b(x), block, x)
    sizes.append(int(np.prod(x.shape[1:])))
  return sizes


def main(argv):
  del argv
  print("| model | blocks | parameters | float32 MiB | published |")
  print("|---|---:|---:|---:|---|")
  built, counts = {}, {}
  for name, make, shape, published in MODELS:
    blocks = nnx.eval_shape(make)
    built[name] = (blocks, shape)
    n = sum(block_params(blocks))
    counts[name] = {"blocks": len(blocks), "parameters": n}
    print(f"| {name} | {len(blocks)} | {n:,} | {n * 4 / 2**20:.1f} | "
          f"{published} |")

  blocks, shape = built["ResNet-152"]
  ours = list(zip(block_params(blocks), block_outputs(blocks, shape)))
  theirs = [(b.params, b.output) for b in analytic.resnet152()]
  same = sum(a == b for a, b in zip(ours, theirs))
  print(f"\nResNet-152, stalepipe.models vs stalepipe.plan.analytic: "
        f"{len(ours)} vs {len(theirs)} blocks; {same} agree in both "
        "parameters and output elements per sample.")
  for i, (a, b) in enumerate(zip(ours, theirs)):
    if a != b:
      print(f"  block {i}: models (params, output) = {a}, analytic = {b}")
  harness.record("model_sizes", {
      "models": counts, "resnet152_blocks_vs_analytic": {
          "models": len(ours), "analytic": len(theirs), "agree": same}})


if __name__ == "__main__":
  harness.run(main)
