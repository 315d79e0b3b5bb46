"""Tests for the data pipelines: CIFAR-10 pickles, char corpus, synthetic."""

import os
import pickle

import numpy as np
import pytest

from stalepipe import data
from stalepipe.data.cifar10 import TEST_FILE, TRAIN_FILES

BATCH = 3  # images per fake training batch file


def _write_cifar(directory, rng):
  """The real on-disk format, with `BATCH` random images per training file."""
  os.makedirs(directory)
  batches = {}
  for name in TRAIN_FILES + (TEST_FILE,):
    n = 2 if name == TEST_FILE else BATCH
    batch = {b"batch_label": name.encode(),
             b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             b"labels": rng.integers(0, 10, n).tolist(),
             b"filenames": [b"x.png"] * n}
    with open(os.path.join(directory, name), "wb") as f:
      pickle.dump(batch, f)
    batches[name] = batch
  return batches


def _expected_images(rows):
  """Pixel (h, w, c) of a row is byte c*1024 + h*32 + w, then normalised."""
  n = len(rows)
  out = np.empty((n, 32, 32, 3), np.float64)
  for c in range(3):
    for h in range(32):
      out[:, h, :, c] = rows[:, c * 1024 + h * 32: c * 1024 + h * 32 + 32]
  mean = np.array([0.4914, 0.4822, 0.4465])
  std = np.array([0.2470, 0.2435, 0.2616])
  return (out / 255.0 - mean) / std


@pytest.fixture(name="cifar_dir")
def fixture_cifar_dir(tmp_path):
  root = tmp_path / "cifar-10-batches-py"
  return str(root), _write_cifar(str(root), np.random.default_rng(0))


def test_cifar10_reads_the_pickle_format(cifar_dir):
  directory, batches = cifar_dir
  ds = data.cifar10(directory)
  train = [batches[name] for name in TRAIN_FILES]
  rows = np.concatenate([b[b"data"] for b in train])
  assert ds.x_train.shape == (5 * BATCH, 32, 32, 3)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  np.testing.assert_allclose(ds.x_train, _expected_images(rows), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(
      ds.y_train, np.concatenate([b[b"labels"] for b in train]))
  test = batches[TEST_FILE]
  np.testing.assert_allclose(ds.x_test, _expected_images(test[b"data"]),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ds.y_test, test[b"labels"])
  assert ds.num_classes == 10
  # The directory that holds cifar-10-batches-py works too.
  np.testing.assert_array_equal(
      data.cifar10(os.path.dirname(directory)).x_train, ds.x_train)


def test_cifar10_shards_partition_the_training_set(cifar_dir):
  directory, _ = cifar_dir
  whole = data.cifar10(directory)
  shards = [data.cifar10(directory, process_index=i, process_count=2)
            for i in range(2)]
  # 5 files of 3 rows: global rows 0, 2, 4, ... and 1, 3, 5, ...
  for i, part in enumerate(shards):
    np.testing.assert_array_equal(part.x_train, whole.x_train[i::2])
    np.testing.assert_array_equal(part.y_train, whole.y_train[i::2])
    np.testing.assert_array_equal(part.x_test, whole.x_test)


def test_cifar10_names_the_missing_file(cifar_dir):
  directory, _ = cifar_dir
  os.remove(os.path.join(directory, "data_batch_3"))
  with pytest.raises(FileNotFoundError, match="'data_batch_3'.*" + directory):
    data.cifar10(directory)
  with pytest.raises(ValueError, match="process_index=2"):
    data.cifar10(directory, process_index=2, process_count=2)


def test_chars_round_trips_and_windows_the_text():
  text = data.zen_text()
  assert text.startswith("The Zen of Python, by Tim Peters")
  vocab = data.chars_vocab(text)
  assert vocab.decode(vocab.encode(text)) == text
  assert list(vocab.chars) == sorted(set(text))
  seq_len, stride = 16, 5
  ds = data.chars(seq_len, text=text, stride=stride, test_fraction=0.25)
  assert ds.x_train.dtype == np.int32 and ds.num_classes == len(set(text))
  num_train = len(text) - round(0.25 * len(text))
  assert len(ds.x_train) == (num_train - seq_len - 1) // stride + 1
  for k in (0, 1, len(ds.x_train) - 1):
    start = k * stride
    assert vocab.decode(ds.x_train[k]) == text[start:start + seq_len]
    assert vocab.decode(ds.y_train[k]) == text[start + 1:start + seq_len + 1]
  assert vocab.decode(ds.x_test[0]) == text[num_train:num_train + seq_len]
  with pytest.raises(ValueError, match="not in the vocabulary"):
    vocab.encode("\u00e9")


def test_chars_default_corpus_and_shards():
  whole = data.chars(32)
  vocab = data.chars_vocab()
  text = data.stdlib_text()
  assert vocab.decode(whole.x_train[2]) == text[64:96]
  shards = [data.chars(32, process_index=i, process_count=2)
            for i in range(2)]
  assert sum(len(s.x_train) for s in shards) == len(whole.x_train)
  for i, part in enumerate(shards):
    np.testing.assert_array_equal(part.x_train, whole.x_train[i::2])
    np.testing.assert_array_equal(part.y_train, whole.y_train[i::2])
  with pytest.raises(ValueError, match="seq_len"):
    data.chars(100, text="short text")


def test_synthetic_is_deterministic_per_seed():
  a = data.synthetic(64, 16, in_features=4, num_classes=3, seed=3)
  b = data.synthetic(64, 16, in_features=4, num_classes=3, seed=3)
  c = data.synthetic(64, 16, in_features=4, num_classes=3, seed=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.x_train, c.x_train)
  assert a.x_train.shape == (64, 4) and a.x_train.dtype == np.float32
  assert a.y_train.dtype == np.int32 and set(a.y_train) <= set(range(3))
  assert len(set(a.y_train)) > 1  # the teacher is not constant
  assert not np.array_equal(a.x_train[:16], a.x_test)  # distinct splits


def test_synthetic_shards_partition_the_training_set():
  whole = data.synthetic(50, 8, in_features=4, num_classes=3)
  shards = [data.synthetic(50, 8, in_features=4, num_classes=3,
                           process_index=i, process_count=2)
            for i in range(2)]
  for i, part in enumerate(shards):
    np.testing.assert_array_equal(part.x_train, whole.x_train[i::2])
    np.testing.assert_array_equal(part.y_train, whole.y_train[i::2])
    np.testing.assert_array_equal(part.x_test, whole.x_test)


def test_synthetic_regression_noise_has_the_given_std():
  kwargs = dict(in_features=4, num_classes=3, task="regression")
  clean = data.synthetic(2000, 1, **kwargs)
  noisy = data.synthetic(2000, 1, noise_std=0.5, **kwargs)
  np.testing.assert_array_equal(clean.x_train, noisy.x_train)
  noise = noisy.y_train - clean.y_train
  assert clean.num_classes == 0 and noise.shape == (2000, 3)
  assert abs(noise.std() - 0.5) < 0.03 and abs(noise.mean()) < 0.03
  with pytest.raises(ValueError, match="task='ranking'"):
    data.synthetic(task="ranking")
