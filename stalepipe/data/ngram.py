"""The trivial baselines of a byte-level corpus: n-gram models' cross-entropies.

A language model's validation loss means something only against what
counting gets: the unigram model (byte frequencies), the bigram and trigram
models. A target above the unigram level times how fast a run learns which
bytes are common; one below the bigram level needs context.
"""

import numpy as np

VOCAB = 256


def _codes(tokens: np.ndarray, order: int) -> np.ndarray:
  """Each length-`order` run of `tokens` (along the last axis) as one int:
  `t_0 V^{n-1} + ... + t_{n-1}`."""
  tokens = np.asarray(tokens, np.int64)
  n = tokens.shape[-1] - order + 1
  codes = np.zeros(tokens.shape[:-1] + (max(n, 0),), np.int64)
  for k in range(order):
    codes = codes * VOCAB + tokens[..., k:k + n]
  return codes


def counts(train: np.ndarray, order: int) -> np.ndarray:
  """`[V^(order-1), V]` counts of each byte after each context in `train`
  (a 1-D byte sequence)."""
  found = np.bincount(_codes(train, order), minlength=VOCAB ** order)
  return found.reshape(-1, VOCAB).astype(np.float64)


def cross_entropy(train: np.ndarray, x: np.ndarray, y: np.ndarray,
                  order: int, alpha: float = 0.1) -> float:
  r"""Mean nats per target of the order-`n` model of `train` on windows `(x, y)`.

  The model is the training counts with additive (Lidstone) smoothing,

  .. math::
    p(b \mid c) = \frac{N(c\,b) + \alpha}{N(c) + V \alpha},

  with `c` the `n - 1` bytes before target `b` inside its window (`x`
  holds a window's inputs, `y` its next bytes: `y[i] = x[i+1]`); the first
  targets of a window, with fewer bytes before them, take the longest
  context they have (a model of the window sees no more).

  Args:
    train: the training bytes, 1-D.
    x: `[N, L]` input windows.
    y: `[N, L]` their next bytes.
    order: `n`: 1 (byte frequencies), 2 (bigram) or 3 (trigram).
    alpha: the smoothing :math:`\alpha > 0`.

  Returns:
    The cross-entropy in nats per byte, averaged over every target.

  Examples:
    >>> train = np.frombuffer(b"abababab", np.uint8)
    >>> x = np.frombuffer(b"ab", np.uint8)[None]
    >>> y = np.frombuffer(b"ba", np.uint8)[None]
    >>> round(cross_entropy(train, x, y, 2, alpha=1e-9), 6)  # b|a, a|b: sure
    0.0
  """
  if order not in (1, 2, 3) or alpha <= 0:
    raise ValueError(f"order={order}, alpha={alpha} are invalid; valid: "
                     "order 1, 2 or 3 (a table of 256^order counts), "
                     "alpha > 0")
  x, y = np.asarray(x, np.int64), np.asarray(y, np.int64)
  if order == 1:
    parts = [(1, y[..., None])]
  else:
    # The window's bytes with its last target: x[0], y[0], ..., y[L-1];
    # target y[j] has the j + 1 bytes seq[0..j] before it.
    seq = np.concatenate([x[:, :1], y], axis=1)
    parts = [(j + 2, _codes(seq[:, :j + 2], j + 2))
             for j in range(min(order - 2, y.shape[1]))]
    parts.append((order, _codes(seq, order)))  # targets y[j], j >= order - 2
  nll, n = 0.0, 0
  for k, grams in parts:
    table = counts(train, k)
    ctx, b = grams // VOCAB, grams % VOCAB
    p = (table[ctx, b] + alpha) / (table.sum(axis=1)[ctx] + VOCAB * alpha)
    nll -= np.log(p).sum()
    n += p.size
  return float(nll / n)
