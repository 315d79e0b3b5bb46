"""CIFAR-10 from the standard python-pickle batches in a local directory.

The "CIFAR-10 python version" is a directory `cifar-10-batches-py` holding
`data_batch_1` .. `data_batch_5` (50,000 training images) and `test_batch`
(10,000): each a pickled dict with `b'data'`, uint8 [10000, 3072] (the 1024
red, then green, then blue values of a 32x32 image in row-major order), and
`b'labels'`, 10,000 ints in 0..9. Nothing is downloaded: fetch the archive
from the URL below and unpack it yourself.

References:
  Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009
  (<https://www.cs.toronto.edu/~kriz/cifar.html>, "Dataset layout").
"""

import os
import pickle

import numpy as np

from stalepipe.data.digits import Dataset

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
# Per-channel mean and standard deviation of the 50,000 training images
# (pixel values in [0, 1]); fixed, so a process needs only its own shard.
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)


def _resolve(data_dir: str) -> str:
  """`data_dir`, or its `cifar-10-batches-py` subdirectory holding the data."""
  nested = os.path.join(data_dir, "cifar-10-batches-py")
  if (not os.path.exists(os.path.join(data_dir, TEST_FILE))
      and os.path.isdir(nested)):
    return nested
  return data_dir


def load_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
  """One pickle batch: uint8 NHWC images [n, 32, 32, 3], int32 labels [n].

  Examples:
    >>> import os, pickle, tempfile
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "test_batch")
    >>> data = np.arange(2 * 3072, dtype=np.uint32).astype(np.uint8)
    >>> with open(path, "wb") as f:
    ...   pickle.dump({b"data": data.reshape(2, 3072), b"labels": [3, 7]}, f)
    >>> images, labels = load_batch(path)
    >>> images.shape, labels.tolist()
    ((2, 32, 32, 3), [3, 7])
  """
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")
  data = np.asarray(batch[b"data"], np.uint8)
  if data.ndim != 2 or data.shape[1] != 3072:
    raise ValueError(f"{path} holds b'data' of shape {data.shape}; valid: "
                     "[n, 3072] uint8")
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return images, np.asarray(batch[b"labels"], np.int32)


def normalize(images: np.ndarray) -> np.ndarray:
  """uint8 images -> float32 `(x / 255 - mean_c) / std_c` per channel `c`.

  .. math::
    \\hat x_{nhwc} = (x_{nhwc} / 255 - \\mu_c) / \\sigma_c
  """
  return (images.astype(np.float32) / 255.0 - MEAN) / STD


def cifar10(data_dir: str, *, process_index: int = 0,
            process_count: int = 1) -> Dataset:
  """The CIFAR-10 train and test sets from local pickle batches.

  Args:
    data_dir: the `cifar-10-batches-py` directory, or a directory holding it.
    process_index: this process's index, for multi-host loading.
    process_count: number of processes; each keeps every `process_count`-th
      training image starting at `process_index` (of the 50,000 in file
      order), reading one batch file at a time. The test set is whole.

  Returns:
    The data set: float32 NHWC images [N, 32, 32, 3] normalised per channel
    with `MEAN` and `STD`, int32 labels [N], 10 classes.

  Raises:
    FileNotFoundError: when a batch file is missing, naming it and the
      directory.

  References:
    Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009.

  Examples:
    >>> cifar10("/nonexistent")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: CIFAR-10 batch 'data_batch_1' is missing from ...
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is invalid; valid: 0 to "
                     f"{process_count - 1}")
  data_dir = _resolve(os.path.expanduser(data_dir))
  for name in TRAIN_FILES + (TEST_FILE,):
    if not os.path.isfile(os.path.join(data_dir, name)):
      raise FileNotFoundError(
          f"CIFAR-10 batch {name!r} is missing from {data_dir}; expected the "
          f"python version's {', '.join(TRAIN_FILES)} and {TEST_FILE} there "
          "(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz)")
  x_train, y_train, offset = [], [], 0
  for name in TRAIN_FILES:
    images, labels = load_batch(os.path.join(data_dir, name))
    # Keep global rows process_index, process_index + process_count, ...
    first = (process_index - offset) % process_count
    x_train.append(normalize(images[first::process_count]))
    y_train.append(labels[first::process_count])
    offset += len(labels)
  x_test, y_test = load_batch(os.path.join(data_dir, TEST_FILE))
  return Dataset(np.concatenate(x_train), np.concatenate(y_train),
                 normalize(x_test), y_test, num_classes=10)
