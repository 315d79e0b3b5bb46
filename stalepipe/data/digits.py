"""scikit-learn's handwritten digits (8x8 images, 10 classes; ships with it)."""

from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
  """A supervised data set: NumPy arrays in host memory, or views on a
  memory-mapped file (`stdlib`)."""

  x_train: np.ndarray  # [N_train, ...] float32, or integer token ids
  y_train: np.ndarray  # [N_train] int32, or [N_train, ...] for sequences
  x_test: np.ndarray  # [N_test, ...] as x_train
  y_test: np.ndarray  # [N_test, ...] as y_train
  num_classes: int


def shard(x: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
  """The rows of `x` this process loads: every `process_count`-th row."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is invalid; valid: 0 to "
                     f"{process_count - 1}")
  return x[process_index::process_count]


def digits(*, test_fraction: float = 0.2, seed: int = 0, process_index: int = 0,
           process_count: int = 1) -> Dataset:
  """The 1,797 digits images, flattened to 64 standardised features.

  The split is a seeded permutation; features are standardised with the
  training set's mean and standard deviation.

  Args:
    test_fraction: share of examples held out for testing.
    seed: seed of the train/test permutation.
    process_index: this process's index, for multi-host loading.
    process_count: number of processes; each loads every `process_count`-th
      training example starting at `process_index`. The test set is whole.

  Returns:
    The data set.

  Examples:
    >>> ds = digits()
    >>> ds.x_train.shape, ds.num_classes
    ((1438, 64), 10)
  """
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction={test_fraction} is invalid; valid: "
                     "strictly between 0 and 1")
  x, y = datasets.load_digits(return_X_y=True)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order].astype(np.float32), y[order].astype(np.int32)
  num_test = int(round(test_fraction * len(x)))
  x_train, y_train = x[num_test:], y[num_test:]
  mean, std = x_train.mean(0), x_train.std(0) + 1e-6
  x_train, x_test = (x_train - mean) / std, (x[:num_test] - mean) / std
  return Dataset(shard(x_train, process_index, process_count),
                 shard(y_train, process_index, process_count),
                 x_test, y[:num_test], num_classes=10)
