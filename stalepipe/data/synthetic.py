"""A seeded teacher-network data set of any size, generated row by row.

Inputs are standard normal; targets come from a fixed random teacher MLP,

.. math::
  x \\sim \\mathcal{N}(0, I_d), \\quad
  z = W_2 \\tanh(W_1 x + b_1), \\quad
  y = \\arg\\max_c z_c \\ \\text{(classification)} \\ \\text{or} \\
  y = z + \\sigma \\varepsilon \\ \\text{(regression)},

with `W_1, W_2` of entries `N(0, 1/fan_in)` (NumPy, float64). The draws of
row `i` are a function of `(seed, split, i)` alone (a JAX `fold_in` key), so
a process generates only its own rows and the shards of any process count
partition the same set.

References:
  Saad & Solla, On-line learning in soft committee machines, Phys. Rev. E 52,
  1995 (the teacher-student setting).
"""

import functools

import jax
import numpy as np

from stalepipe.data.digits import Dataset

_TASKS = ("classification", "regression")
_CHUNK = 1024  # rows generated per call


def _teacher(seed: int, in_features: int, hidden: int, out: int):
  rng = np.random.default_rng(seed)
  w1 = rng.normal(size=(in_features, hidden)) / np.sqrt(in_features)
  b1 = 0.1 * rng.normal(size=hidden)
  w2 = rng.normal(size=(hidden, out)) / np.sqrt(hidden)
  return w1, b1, w2


@functools.partial(jax.jit, static_argnums=(2, 3))
def _draws(key, indices, in_features, out):
  """Inputs [n, in_features] and noise [n, out] of the rows `indices`."""
  def row(i):
    kx, kn = jax.random.split(jax.random.fold_in(key, i))
    return (jax.random.normal(kx, (in_features,)),
            jax.random.normal(kn, (out,)))
  return jax.vmap(row)(indices)


def synthetic(num_train: int = 4096, num_test: int = 1024, *,
              in_features: int = 32, hidden: int = 64, num_classes: int = 10,
              task: str = "classification", noise_std: float = 0.0,
              seed: int = 0, process_index: int = 0,
              process_count: int = 1) -> Dataset:
  """A teacher-network data set, deterministic per seed.

  Args:
    num_train: training examples, over all processes.
    num_test: test examples (every process gets all of them).
    in_features: input width `d`.
    hidden: teacher hidden width.
    num_classes: classes (classification) or output width (regression).
    task: "classification" (int32 labels [N]) or "regression" (float32
      targets [N, num_classes]; `Dataset.num_classes` is then 0).
    noise_std: `sigma`, Gaussian noise added to the teacher's outputs (for
      classification, before the argmax: label noise).
    seed: seed of the teacher and of the examples.
    process_index: this process's index, for multi-host loading.
    process_count: number of processes; each generates every
      `process_count`-th training example starting at `process_index`.

  Returns:
    The data set, float32 inputs [N, in_features].

  References:
    Saad & Solla, On-line learning in soft committee machines, 1995.

  Examples:
    >>> ds = synthetic(100, 20, in_features=8, num_classes=3)
    >>> ds.x_train.shape, ds.y_train.shape, ds.num_classes
    ((100, 8), (100,), 3)
  """
  if task not in _TASKS:
    raise ValueError(f"task={task!r} is invalid; valid: {', '.join(_TASKS)}")
  if min(num_train, num_test) < 0 or min(in_features, hidden, num_classes) < 1:
    raise ValueError(f"sizes num_train={num_train}, num_test={num_test}, "
                     f"in_features={in_features}, hidden={hidden}, "
                     f"num_classes={num_classes} are invalid; valid: counts "
                     ">= 0 and widths >= 1")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is invalid; valid: 0 to "
                     f"{process_count - 1}")
  key = jax.random.key(seed)
  w1, b1, w2 = _teacher(seed, in_features, hidden, num_classes)

  def split(split_id, indices):
    split_key = jax.random.fold_in(key, split_id)
    x = np.zeros((len(indices), in_features), np.float32)
    noise = np.zeros((len(indices), num_classes), np.float32)
    # Fixed-size chunks: one compilation for any number of rows.
    for start in range(0, len(indices), _CHUNK):
      chunk = indices[start:start + _CHUNK]
      x_chunk, noise_chunk = _draws(split_key, np.resize(chunk, _CHUNK),
                                    in_features, num_classes)
      x[start:start + len(chunk)] = x_chunk[:len(chunk)]
      noise[start:start + len(chunk)] = noise_chunk[:len(chunk)]
    z = np.tanh(x.astype(np.float64) @ w1 + b1) @ w2 + noise_std * noise
    if task == "classification":
      return x, z.argmax(-1).astype(np.int32)
    return x, z.astype(np.float32)

  x_train, y_train = split(1, np.arange(process_index, num_train,
                                        process_count))
  x_test, y_test = split(2, np.arange(num_test))
  return Dataset(x_train, y_train, x_test, y_test,
                 num_classes=num_classes if task == "classification" else 0)
