"""Data pipelines: data that ships in a package or with Python, or that is
generated."""

from stalepipe.data.chars import (Vocab, chars, chars_vocab, stdlib_text,
                                  zen_text)
from stalepipe.data.cifar10 import cifar10
from stalepipe.data.digits import Dataset, digits, shard
from stalepipe.data.stdlib_corpus import stdlib, stdlib_files
from stalepipe.data.synthetic import synthetic
from stalepipe import registry

PARTS = registry.Registry(
    "dataset", {"digits": digits, "synthetic": synthetic, "cifar10": cifar10,
                "chars": chars, "stdlib": stdlib},
    filled=("process_index", "process_count"))


def names() -> tuple[str, ...]:
  """The datasets a config may name."""
  return PARTS.names()


def make(name: str, **kwargs) -> Dataset:
  """Loads the dataset registered under `name` (one process's shard where
  `process_index` and `process_count` are given)."""
  return PARTS.make(name, **kwargs)
