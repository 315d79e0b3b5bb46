"""Input: each data replica reads its own shard in a seeded order.

Data replica `r` of `D` owns the training rows `r, r + D, r + 2D, ...` (the
loaders' `process_index=r, process_count=D`), so a process loads only the
shards of the replicas whose devices it holds, and the global batch is the
same for any number of processes. Replica `r` walks its `n_r` rows in epochs,
each a fresh permutation seeded by `(seed, r, epoch)`; window `w` takes
`need = B * M * b` rows:

.. math::
  e = \\lfloor w / \\lfloor n_r / need \\rfloor \\rfloor, \\quad
  k = w \\bmod \\lfloor n_r / need \\rfloor, \\quad
  \\text{rows} = \\pi_{seed, r, e}[k \\cdot need : (k + 1) \\cdot need].

So the window index is the whole data position: a resumed run reads exactly
the rows the uninterrupted one would.
"""

from typing import NamedTuple, Sequence

import numpy as np

from stalepipe import data as data_lib


def load(name: str, kwargs: dict, replica: int, num_replicas: int,
         input_shape: Sequence[int] = ()) -> data_lib.Dataset:
  """Replica `replica`'s training shard (and the whole test set) of `name`.

  Args:
    name: one of `stalepipe.data.names()`.
    kwargs: the loader's keyword arguments (e.g. `data_dir` for cifar10).
    replica: the data replica, `0 <= replica < num_replicas`.
    num_replicas: `D`, data replicas in the whole run.
    input_shape: each example reshaped to this; `()` keeps the loaded shape.

  Returns:
    The shard as a `stalepipe.data.Dataset`.

  Examples:
    >>> ds = load("digits", {}, 1, 2, input_shape=(8, 8, 1))
    >>> ds.x_train.shape[1:], len(ds.x_train) in (718, 719)
    ((8, 8, 1), True)
  """
  ds = data_lib.make(name, **kwargs, process_index=replica,
                     process_count=num_replicas)
  if input_shape:
    shape = tuple(input_shape)
    if int(np.prod(shape)) != int(np.prod(ds.x_train.shape[1:])):
      raise ValueError(f"input_shape {shape} is invalid for examples of shape "
                       f"{ds.x_train.shape[1:]}; valid: the same size")
    ds = ds._replace(x_train=ds.x_train.reshape((-1,) + shape),
                     x_test=ds.x_test.reshape((-1,) + shape))
  return ds


class Shard(NamedTuple):
  """One data replica's training rows."""

  replica: int
  x: np.ndarray  # [n_r, ...]
  y: np.ndarray  # [n_r, ...]


def window_rows(window: int, num_rows: int, need: int, seed: int,
                replica: int) -> np.ndarray:
  """The row indices [need] replica `replica` reads in window `window`.

  Examples:
    >>> rows = [window_rows(w, 10, 4, 0, 0) for w in range(3)]
    >>> len(set(rows[0]) | set(rows[1])), len(set(rows[2]))
    (8, 4)
  """
  per_epoch = num_rows // need
  if per_epoch < 1:
    raise ValueError(f"a window needs {need} examples per data replica but a "
                     f"replica's shard has {num_rows}; valid: fewer "
                     "micro-batches, minibatches per window or a smaller "
                     "micro-batch")
  epoch, k = divmod(window, per_epoch)
  order = np.random.default_rng([seed, replica, epoch]).permutation(num_rows)
  return order[k * need:(k + 1) * need]


def window_batch(shards: Sequence[Shard], window: int, num_minibatches: int,
                 num_microbatches: int, microbatch_size: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
  """This process's inputs and targets `[B, M, len(shards) * b, ...]`.

  The local replicas' micro-batches sit side by side on axis 2, in the
  order of `shards` (ascending replica), as the executor splits it.
  """
  B, M, b = num_minibatches, num_microbatches, microbatch_size
  xs, ys = [], []
  for shard in shards:
    rows = window_rows(window, len(shard.x), B * M * b, seed, shard.replica)
    xs.append(shard.x[rows].reshape((B, M, b) + shard.x.shape[1:]))
    ys.append(shard.y[rows].reshape((B, M, b) + shard.y.shape[1:]))
  return np.concatenate(xs, axis=2), np.concatenate(ys, axis=2)
