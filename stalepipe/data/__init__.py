"""Data pipelines: data that ships in a package, or that is generated."""

from stalepipe.data.chars import (Vocab, chars, chars_vocab, stdlib_text,
                                  zen_text)
from stalepipe.data.cifar10 import cifar10
from stalepipe.data.digits import Dataset, digits, shard
from stalepipe.data.synthetic import synthetic
