"""A character-level language-modelling corpus from text shipped with Python.

The default corpus is the source of a few pure-Python standard-library modules
(read from disk, so it changes only with the Python version); `zen_text()` is
the Zen of Python. A `Vocab` maps characters to ids; `chars` cuts the ids into
windows of `L` tokens, each paired with the `L` tokens that follow them, the
targets of next-token prediction:

.. math::
  x^{(k)} = (t_{s_k}, \\dots, t_{s_k + L - 1}), \\quad
  y^{(k)} = (t_{s_k + 1}, \\dots, t_{s_k + L}), \\quad s_k = k \\cdot
  \\mathrm{stride}.

References:
  Karpathy, The Unreasonable Effectiveness of Recurrent Neural Networks
  <https://karpathy.github.io/2015/05/21/rnn-effectiveness/>, 2015 (char-level
  LM on source code); Radford et al, Language Models are Unsupervised
  Multitask Learners, 2019 (§2: next-token objective).
"""

import ast
import codecs
import importlib.util
from typing import NamedTuple, Sequence

import numpy as np

from stalepipe.data.digits import Dataset, shard

DEFAULT_MODULES = ("difflib", "textwrap", "string", "argparse")


def stdlib_text(modules: Sequence[str] = DEFAULT_MODULES) -> str:
  """The concatenated source files of standard-library `modules`.

  Examples:
    >>> "A collection of string constants" in stdlib_text(["string"])
    True
  """
  texts = []
  for name in modules:
    spec = importlib.util.find_spec(name)
    if spec is None or not (spec.origin or "").endswith(".py"):
      raise ValueError(f"module {name!r} is invalid; valid: a standard-library"
                       " module shipped as a .py source file")
    with open(spec.origin, encoding="utf-8") as f:
      texts.append(f.read())
  return "\n".join(texts)


def zen_text() -> str:
  """The Zen of Python, decoded from `this.py` (importing it would print it).

  Examples:
    >>> zen_text().splitlines()[0]
    'The Zen of Python, by Tim Peters'
  """
  with open(importlib.util.find_spec("this").origin, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  rot13 = next(node.value.value for node in tree.body
               if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", None) == "s")
  return codecs.decode(rot13, "rot13")


class Vocab(NamedTuple):
  """The characters of a corpus, sorted; id `i` is `chars[i]`."""

  chars: str

  @classmethod
  def of(cls, text: str) -> "Vocab":
    """The vocabulary of the distinct characters in `text`."""
    return cls("".join(sorted(set(text))))

  @property
  def size(self) -> int:
    """Number of ids, the width of a language model's logits."""
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """`text` as int32 ids [len(text)].

    Examples:
      >>> Vocab.of("hello").encode("hole").tolist()
      [1, 3, 2, 0]
    """
    lookup = {c: i for i, c in enumerate(self.chars)}
    unknown = set(text) - lookup.keys()
    if unknown:
      raise ValueError(f"characters {''.join(sorted(unknown))!r} are not in "
                       f"the vocabulary; valid: {self.chars!r}")
    return np.array([lookup[c] for c in text], np.int32)

  def decode(self, ids) -> str:
    """The text of int ids (any shape, read in row-major order)."""
    ids = np.asarray(ids).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= len(self.chars)):
      raise ValueError(f"ids in [{ids.min()}, {ids.max()}] are invalid; "
                       f"valid: 0 to {len(self.chars) - 1}")
    return "".join(self.chars[i] for i in ids)


def chars_vocab(text: str | None = None) -> Vocab:
  """The vocabulary of `chars(..., text=text)` (the default corpus if None)."""
  return Vocab.of(stdlib_text() if text is None else text)


def windows(ids: np.ndarray, seq_len: int, stride: int) -> np.ndarray:
  """The windows of `seq_len + 1` ids starting at multiples of `stride`: a
  view on `ids`, not a copy."""
  if len(ids) < seq_len + 1:
    return np.zeros((0, seq_len + 1), ids.dtype)
  return np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]


def window_stride(seq_len: int, stride: int | None,
                  test_fraction: float) -> int:
  """The stride between windows (`seq_len` when None), once the windowing
  arguments are checked."""
  stride = seq_len if stride is None else stride
  if seq_len < 1 or stride < 1:
    raise ValueError(f"seq_len={seq_len}, stride={stride} are invalid; "
                     "valid: both >= 1")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction={test_fraction} is invalid; valid: "
                     "strictly between 0 and 1")
  return stride


def chars(seq_len: int = 64, *, text: str | None = None,
          stride: int | None = None, test_fraction: float = 0.1,
          process_index: int = 0, process_count: int = 1) -> Dataset:
  """Windows of `seq_len` character ids and their next characters.

  The first `1 - test_fraction` of the text trains and the rest tests, so no
  test window overlaps a training one.

  Args:
    seq_len: `L`, tokens per window.
    text: the corpus; `stdlib_text()` when None.
    stride: distance between window starts; `seq_len` (disjoint windows)
      when None.
    test_fraction: share of the text held out for testing.
    process_index: this process's index, for multi-host loading.
    process_count: number of processes; each keeps every `process_count`-th
      training window starting at `process_index`. The test set is whole.

  Returns:
    The data set: int32 tokens `x` [N, L], int32 next tokens `y` [N, L], and
    `num_classes` the vocabulary size (`chars_vocab(text)` decodes them).

  References:
    Radford et al, Language Models are Unsupervised Multitask Learners, 2019.

  Examples:
    >>> ds = chars(4, text="abcdefghij" * 10, test_fraction=0.2)
    >>> vocab = chars_vocab("abcdefghij" * 10)
    >>> vocab.decode(ds.x_train[0]), vocab.decode(ds.y_train[0])
    ('abcd', 'bcde')
  """
  stride = window_stride(seq_len, stride, test_fraction)
  text = stdlib_text() if text is None else text
  vocab = Vocab.of(text)
  ids = vocab.encode(text)
  num_train = len(ids) - int(round(test_fraction * len(ids)))
  train = shard(windows(ids[:num_train], seq_len, stride), process_index,
                process_count)
  test = windows(ids[num_train:], seq_len, stride)
  if not len(train) or not len(test):
    raise ValueError(f"seq_len={seq_len} is invalid for a text of {len(ids)} "
                     "characters; valid: short enough for a window in both "
                     "the training and the test part")
  return Dataset(train[:, :-1].copy(), train[:, 1:].copy(),
                 test[:, :-1].copy(), test[:, 1:].copy(),
                 num_classes=vocab.size)
