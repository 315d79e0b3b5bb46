"""Losses `loss_fn(y, target) -> scalar mean` matching the models' outputs."""

import jax
import jax.numpy as jnp
import optax

from stalepipe import registry


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross-entropy of logits [b, n] against labels [b], mean over b.

  .. math::
    \\ell = \\frac{1}{b} \\sum_i \\Big(\\log \\sum_c e^{z_{ic}} - z_{i y_i}\\Big)

  Args:
    logits: [b, n] unnormalised class scores.
    labels: [b] integer classes in `[0, n)`.

  Returns:
    The mean loss, a float scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> round(float(cross_entropy(jnp.zeros((3, 4)), jnp.array([0, 1, 2]))), 4)
    1.3863
  """
  if logits.ndim != 2 or labels.shape != logits.shape[:1]:
    raise ValueError(f"logits {logits.shape} and labels {labels.shape} are "
                     "invalid; valid: [b, n] and [b]")
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels.astype(jnp.int32)).mean()


def lm_cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of logits [b, L, V] against targets [b, L].

  `tokens[:, i]` is the token that follows position `i` (a window's next
  tokens, as `stalepipe.data.chars` gives them); the mean is over all `b L`
  positions, so `exp` of it is the perplexity.

  Args:
    logits: [b, L, V] unnormalised next-token scores.
    tokens: [b, L] integer targets in `[0, V)`.

  Returns:
    The mean loss, a float scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> logits, tokens = jnp.zeros((2, 5, 8)), jnp.zeros((2, 5), int)
    >>> round(float(lm_cross_entropy(logits, tokens)), 4)
    2.0794
  """
  if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
    raise ValueError(f"logits {logits.shape} and tokens {tokens.shape} are "
                     "invalid; valid: [b, L, V] and [b, L]")
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens.astype(jnp.int32)).mean()


def mean_squared_error(y: jax.Array, target: jax.Array) -> jax.Array:
  """`mean((y - target)**2)` over all elements, for regression.

  Examples:
    >>> import jax.numpy as jnp
    >>> float(mean_squared_error(jnp.ones((2, 3)), jnp.zeros((2, 3))))
    1.0
  """
  if y.shape != target.shape:
    raise ValueError(f"target shape {target.shape} is invalid; valid: the "
                     f"output shape {y.shape}")
  return jnp.mean((y - target) ** 2)


PARTS = registry.Registry("loss", {
    "cross_entropy": lambda: cross_entropy,
    "lm_cross_entropy": lambda: lm_cross_entropy})


def names() -> tuple[str, ...]:
  """The losses a config may name."""
  return PARTS.names()


def make(name: str):
  """The loss function registered under `name`.

  Examples:
    >>> make("cross_entropy") is cross_entropy
    True
  """
  return PARTS.make(name)
