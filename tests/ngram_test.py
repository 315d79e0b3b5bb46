"""n-gram baselines against a plain count in Python dicts."""

import collections
import math

import numpy as np
import pytest

from stalepipe.data import ngram


def _by_hand(train, x, y, order, alpha):
  """Each target's probability under the smoothed counts, by dictionaries."""
  train = [int(b) for b in train]
  nll, n = 0.0, 0
  for xs, ys in zip(x.tolist(), y.tolist()):
    seq = [xs[0]] + ys
    for j, target in enumerate(ys):
      k = min(order - 1, j + 1)  # bytes of context inside the window
      ctx = tuple(seq[j + 1 - k:j + 1])
      grams = collections.Counter(tuple(train[i:i + k + 1])
                                  for i in range(len(train) - k))
      ctx_n = sum(c for g, c in grams.items() if g[:k] == ctx)
      p = (grams[ctx + (target,)] + alpha) / (ctx_n + 256 * alpha)
      nll -= math.log(p)
      n += 1
  return nll / n


@pytest.mark.parametrize("order", [1, 2, 3])
def test_cross_entropy_equals_counting_by_hand(order):
  rng = np.random.default_rng(order)
  train = rng.choice(np.arange(97, 101), size=300, p=[.5, .3, .15, .05])
  windows = rng.choice(np.arange(96, 101), size=(3, 6))
  x, y = windows[:, :-1], windows[:, 1:]
  np.testing.assert_allclose(ngram.cross_entropy(train, x, y, order, 0.1),
                             _by_hand(train, x, y, order, 0.1), rtol=1e-12)


def test_bad_order_or_alpha_is_one_line():
  with pytest.raises(ValueError, match="order=4, alpha=0.1 are invalid"):
    ngram.cross_entropy(np.zeros(4), np.zeros((1, 2)), np.zeros((1, 2)), 4)
