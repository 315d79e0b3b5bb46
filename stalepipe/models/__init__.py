"""Flax NNX models written as sequences of blocks, and a splitter into stages."""

from typing import Any

import numpy as np

from stalepipe import registry
from stalepipe.models import losses
from stalepipe.models.cnn import VGG16, VGG19, vgg
from stalepipe.models.mlp import mlp
from stalepipe.models.resnet import RESNET18, RESNET50, RESNET152, resnet
from stalepipe.models.staging import (Staged, cut, even_boundaries, merge,
                                      split, unpipelined)
from stalepipe.models.transformer import transformer

PARTS = registry.Registry(
    "model", {"mlp": mlp, "vgg": vgg, "resnet": resnet,
              "transformer": transformer},
    # What the data decide (`data_kwargs`) and the run's seed.
    filled=("in_features", "num_classes", "vocab_size", "max_len",
            "in_channels", "image_size", "seed"))


def names() -> tuple[str, ...]:
  """The names `make` accepts."""
  return PARTS.names()


def make(name: str, **kwargs):
  """Builds the blocks of the model registered under `name`."""
  return PARTS.make(name, **kwargs)


def data_kwargs(name: str, example: np.ndarray, num_classes: int
                ) -> dict[str, Any]:
  """The arguments of model `name` that the data decide (input and output
  widths), from one `example` and the number of classes.

  Examples:
    >>> data_kwargs("mlp", np.zeros((8, 8)), 10)
    {'in_features': 64, 'num_classes': 10}
  """
  PARTS.factory(name)
  if name == "mlp":
    return {"in_features": int(np.prod(example.shape)),
            "num_classes": num_classes}
  if name in ("vgg", "resnet"):
    if example.ndim != 3:
      raise ValueError(f"model {name!r} needs images [h, w, c], not examples "
                       f"of shape {example.shape}; valid: set input_shape")
    extra = {"image_size": example.shape[0]} if name == "vgg" else {}
    return {"num_classes": num_classes, "in_channels": example.shape[-1],
            **extra}
  if name == "transformer":
    return {"vocab_size": num_classes, "max_len": example.shape[0]}
  return {}
