"""Flax NNX models written as sequences of blocks, and a splitter into stages."""

from stalepipe.models import losses
from stalepipe.models.cnn import VGG16, VGG19, vgg
from stalepipe.models.mlp import mlp
from stalepipe.models.resnet import RESNET18, RESNET50, RESNET152, resnet
from stalepipe.models.staging import (Staged, cut, even_boundaries, merge,
                                      split, unpipelined)
from stalepipe.models.transformer import transformer

_REGISTRY = {"mlp": mlp, "vgg": vgg, "resnet": resnet,
             "transformer": transformer}


def names() -> tuple[str, ...]:
  return tuple(_REGISTRY)


def make(name: str, **kwargs):
  """Builds the blocks of the model registered under `name`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}")
  return _REGISTRY[name](**kwargs)
