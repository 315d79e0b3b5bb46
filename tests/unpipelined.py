"""The user's own unpipelined optax loop, which pipelined runs must equal."""

import jax
import optax


def train(loss, params, optimizer, windows):
  """Plain optax on `params`: one update per minibatch, on the mean of its
  micro-batches' gradients of `loss(params, x, y)`; windows `[B, M, ...]`."""
  state = optimizer.init(params)
  for x, y in windows:
    for i in range(x.shape[0]):
      grads = [jax.grad(loss)(params, x[i, m], y[i, m])
               for m in range(x.shape[1])]
      mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
      updates, state = optimizer.update(mean, state, params)
      params = optax.apply_updates(params, updates)
  return params
