"""The optimizer of a config: stalepipe.optim transforms, then an optax alias.

A config names its update rule as pure data, after big_vision's
`optax.py: make`:

.. code-block:: python

  config.transforms = (("stale_gradients", {"delay": 1}),
                       ("delay_compensation", {"lam": 0.2}))
  config.optimizer = "adam"
  config.optimizer_kwargs = {"learning_rate": 1e-3}

gives `optax.chain(stale_gradients(1), delay_compensation(0.2), adam(1e-3))`.
Transforms that take extra arguments (`delay_compensation`'s
`stale_params`) receive them through `optax.chain`.
"""

from typing import Any, Sequence

import optax

from stalepipe import optim

TRANSFORMS = ("stale_gradients", "delay_compensation", "scale_by_staleness",
              "scale_by_variance_reduced_adam", "wave_accumulation")


def make(transforms: Sequence[tuple[str, dict[str, Any]]], optimizer: str,
         optimizer_kwargs: dict[str, Any],
         num_replicas: int = 1) -> optax.GradientTransformation:
  """Chains the named `stalepipe.optim` transforms before `optax.<optimizer>`.

  Args:
    transforms: `(name, kwargs)` pairs, names from `TRANSFORMS`.
    optimizer: an optax alias such as `sgd`, `adam`, `adamw`.
    optimizer_kwargs: its keyword arguments.
    num_replicas: the data replicas; `scale_by_variance_reduced_adam`'s
      `num_workers` (SDPipe's N) defaults to it.

  Returns:
    The optimizer; `optax.GradientTransformationExtraArgs` when transforms
    are chained.

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = make((("stale_gradients", {"delay": 1}),), "sgd",
    ...            {"learning_rate": 0.1})
    >>> x = jnp.ones(2)
    >>> state = opt.init(x)
    >>> u0, state = opt.update(x, state, x)
    >>> u1, state = opt.update(2 * x, state, x)
    >>> [round(float(v), 4) for v in (u0[0], u1[0])]
    [-0.0, -0.1]
  """
  factory = getattr(optax, optimizer, None)
  if factory is None or not callable(factory) or optimizer.startswith("_"):
    raise ValueError(f"unknown optimizer {optimizer!r}; valid: an optax alias "
                     "such as sgd, adam, adamw")
  chain = []
  for entry in transforms:
    if len(entry) != 2:
      raise ValueError(f"transform {entry!r} is invalid; valid: a (name, "
                       "kwargs) pair")
    name, kwargs = entry
    if name not in TRANSFORMS:
      raise ValueError(f"unknown transform {name!r}; valid: "
                       f"{', '.join(TRANSFORMS)}")
    kwargs = dict(kwargs)
    if name == "scale_by_variance_reduced_adam":
      kwargs.setdefault("num_workers", num_replicas)
    chain.append(getattr(optim, name)(**kwargs))
  base = factory(**dict(optimizer_kwargs))
  return optax.chain(*chain, base) if chain else base
