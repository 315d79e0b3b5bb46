r"""A stage function as a researcher writes it, and what the executors call.

A stage is `f(params, x) -> y`, with `x` and `y` pytrees of arrays. It may
also declare keyword arguments the executors then pass:

- `key`: a PRNG key (`jax.random.key`) for this (minibatch, micro-batch,
  stage, data replica), derived from the pipeline's `seed`:

  .. math:: k = \mathrm{fold}(\mathrm{fold}(\mathrm{fold}(\mathrm{fold}(
     \mathrm{key}(seed), p), m), s), d)

  so the oracle and the executor, a recomputed forward and a residual
  backward, and a resumed run all see the same randomness (dropout masks);
- `train`: True in a training step.

It may return `Output(value, loss)` instead of `value`: `loss` is an
auxiliary loss of the stage (an MoE load-balancing term; a scalar, the mean
over the micro-batch), added to the objective of its micro-batch,

.. math:: L = \ell(f(x), t) + \sum_s a_s,

with its gradients (through the stage's weights and, by its input, the
stages before it). The executors carry the running sum of the stages' terms
beside each boundary's value, so it reaches the last stage's objective like
any other activation and its cotangent flows back the same way.

Examples:
  >>> import jax
  >>> def stage(params, x, *, key, train):
  ...   keep = jax.random.bernoulli(key, 0.9, x.shape) if train else 1.0
  ...   return (x @ params["w"]) * keep / 0.9
  >>> sorted(wants(stage))
  ['key', 'train']

Inside the executors a stage that wants a key takes it as part of its input,
`(x, key_data)` (`bind`), so every analysis of a stage (residuals, the split
backward) sees the key as an input, never as a constant.
"""

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

ARGUMENTS = ("key", "train")


def wants(fn: Callable) -> frozenset[str]:
  """The keyword arguments of `ARGUMENTS` that `fn` declares."""
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return frozenset()
  return frozenset(a for a in ARGUMENTS if a in parameters)


class Output(NamedTuple):
  """What a stage may return: its value and an auxiliary loss."""

  value: Any  # the stage's output, the next stage's input
  loss: Any = 0.0  # scalar: the stage's auxiliary loss for the micro-batch


def bind(fn: Callable, train: bool, first: bool) -> Callable:
  """`fn` as the executors call it: `(params, x) -> (y, a)`, or, where `fn`
  wants a key, `(params, (x, key_data)) -> (y, a)`; `a` is the float32 sum
  of the auxiliary losses of this stage and the ones before it, which every
  stage after the first takes beside its input: `x = (value, a)`."""
  asked = wants(fn)
  kwargs = {"train": train} if "train" in asked else {}

  def run(p, x, key=None):
    value, carried = (x, 0.0) if first else x
    extra = {} if key is None else {"key": jax.random.wrap_key_data(key)}
    out = fn(p, value, **kwargs, **extra)
    y, aux = (out.value, out.loss) if isinstance(out, Output) else (out, 0.0)
    return y, jnp.asarray(carried, jnp.float32) + jnp.asarray(aux,
                                                              jnp.float32)

  if "key" in asked:
    return lambda p, xk: run(p, xk[0], xk[1])
  return run


def bind_loss(loss_fn: Callable) -> Callable:
  """The objective of a micro-batch from the last bound stage's output:
  `loss_fn(y, target) + a`, `a` the stages' auxiliary losses."""
  return lambda out, target: loss_fn(out[0], target) + out[1]


def key_data(seed: int, minibatch, microbatch, stage, replica) -> jax.Array:
  """The raw key (uint32 data) of one (minibatch, micro-batch, stage,
  replica): traceable, the same in every executor."""
  key = jax.random.key(seed)
  for i in (minibatch, microbatch, stage, replica):
    key = jax.random.fold_in(key, jnp.asarray(i, jnp.uint32))
  return jax.random.key_data(key)


def key_struct() -> jax.ShapeDtypeStruct:
  """The shape of `key_data`'s result."""
  shape = jax.eval_shape(lambda: key_data(0, 0, 0, 0, 0))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype)


def with_key(x, wants_key: bool, seed: int, minibatch, microbatch, stage,
             replica):
  """The input a bound stage takes: `x`, or `(x, key_data)`."""
  if not wants_key:
    return x
  return x, key_data(seed, minibatch, microbatch, stage, replica)


def input_cotangent(g, wants_key: bool):
  """The cotangent of the stage's own input, from that of its bound input."""
  return g[0] if wants_key and g is not None else g

