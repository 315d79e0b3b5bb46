"""Tests for the `stdlib` byte-level corpus: windows, split, cache, views."""

import hashlib
import mmap
import os
import sysconfig

import numpy as np
import pytest

from stalepipe import data
from stalepipe.data import stdlib_corpus
from stalepipe.train import input_pipeline


@pytest.fixture(name="cache", scope="module")
def fixture_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cache"))


def _concatenated(relative_paths) -> bytes:
  root = sysconfig.get_paths()["stdlib"]
  out = []
  for p in relative_paths:
    with open(os.path.join(root, p), "rb") as f:
      out.append(f.read())
  return b"".join(out)


def test_the_split_is_by_file_on_a_hash_of_the_path():
  files = stdlib_corpus.stdlib_files(0.1)
  assert not set(files.train) & set(files.test)
  everything = sorted(files.train + files.test)
  assert list(files.train) == sorted(files.train)
  assert list(files.test) == sorted(files.test)
  for p in everything:
    h = int(hashlib.sha256(p.encode()).hexdigest()[:16], 16) / 16**16
    assert (p in files.test) == (h < 0.1)
  assert len(files.test) > 0.05 * len(everything)
  assert any(p.startswith("test" + os.sep) for p in everything)
  assert not any("site-packages" in p for p in everything)


def test_windows_are_slices_of_the_split_files_bytes(cache):
  seq_len, stride = 32, 24
  ds = data.stdlib(seq_len, stride=stride, cache_dir=cache)
  files = stdlib_corpus.stdlib_files(0.1)
  for x, y, paths in ((ds.x_train, ds.y_train, files.train),
                      (ds.x_test, ds.y_test, files.test)):
    text = np.frombuffer(_concatenated(paths), np.uint8)
    assert len(x) == (len(text) - seq_len - 1) // stride + 1
    for k in (0, 1, len(x) // 2, len(x) - 1):
      start = k * stride
      np.testing.assert_array_equal(x[k], text[start:start + seq_len])
      np.testing.assert_array_equal(y[k], text[start + 1:start + seq_len + 1])
  assert ds.x_train.dtype == ds.y_train.dtype == np.uint8
  assert ds.num_classes == 256


def test_no_test_window_overlaps_a_training_file(cache):
  ds = data.stdlib(64, cache_dir=cache)
  files = stdlib_corpus.stdlib_files(0.1)
  test_text = _concatenated(files.test)
  assert len(ds.x_test) * 64 < len(test_text)  # every window inside it
  train_sizes = sum(files.sizes[p] for p in files.train)
  train, test = stdlib_corpus.corpus_bytes(files, cache)
  assert len(train) == train_sizes and bytes(test) == test_text


def _mapping(a: np.ndarray) -> np.memmap | None:
  """The memory-mapped array `a` is a view of (its chain of bases ends in
  the file's mapping), or None."""
  owner, mapped = a, None
  while getattr(owner, "base", None) is not None:
    mapped = owner if isinstance(owner, np.memmap) else mapped
    owner = owner.base
  return mapped if isinstance(owner, mmap.mmap) else None


def test_arrays_are_views_on_the_memory_mapped_cache(cache):
  ds = data.stdlib(64, cache_dir=cache)
  whole = _mapping(ds.x_train)
  assert whole is not None
  for a in ds[:4]:
    assert np.shares_memory(a, whole) and a.strides == (64, 1)
  shards = [data.stdlib(64, cache_dir=cache, process_index=i,
                        process_count=3) for i in range(3)]
  for i, shard in enumerate(shards):
    assert _mapping(shard.x_train) is not None
    assert shard.x_train.strides == shard.y_train.strides == (3 * 64, 1)
    np.testing.assert_array_equal(shard.x_train[:5], ds.x_train[i::3][:5])
  assert sum(len(s.x_train) for s in shards) == len(ds.x_train)


def test_the_cache_is_written_once_and_reused(tmp_path):
  data.stdlib(16, cache_dir=str(tmp_path))
  (path,) = tmp_path.iterdir()
  assert path.name.startswith("stdlib-py") and path.suffix == ".npy"
  written = path.stat().st_mtime_ns
  data.stdlib(16, stride=3, cache_dir=str(tmp_path))
  assert path.stat().st_mtime_ns == written
  data.stdlib(16, test_fraction=0.2, cache_dir=str(tmp_path))
  assert len(list(tmp_path.iterdir())) == 2  # another split, another file


@pytest.mark.parametrize("damage", ["truncated", "empty", "not npy",
                                    "wrong size"])
def test_a_damaged_cache_file_is_rebuilt(tmp_path, damage):
  want = data.stdlib(16, cache_dir=str(tmp_path))
  want = np.array(want.x_train[:100]), np.array(want.x_test[-100:])
  (path,) = tmp_path.iterdir()
  if damage == "truncated":
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size // 2)
  elif damage == "empty":
    path.write_bytes(b"")
  elif damage == "not npy":
    path.write_bytes(b"partial")
  else:
    np.save(path, np.zeros(1000, np.uint8))
  got = data.stdlib(16, cache_dir=str(tmp_path))
  np.testing.assert_array_equal(got.x_train[:100], want[0])
  np.testing.assert_array_equal(got.x_test[-100:], want[1])
  assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no tmp left


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", fail)
  with pytest.raises(OSError, match="disk full"):
    data.stdlib(16, cache_dir=str(tmp_path))
  assert not list(tmp_path.iterdir())


def test_max_test_windows_keeps_evenly_spaced_windows(cache):
  whole = data.stdlib(64, cache_dir=cache)
  capped = data.stdlib(64, cache_dir=cache, max_test_windows=100)
  step = -(-len(whole.x_test) // 100)
  assert 50 < len(capped.x_test) <= 100
  np.testing.assert_array_equal(capped.x_test, whole.x_test[::step])
  np.testing.assert_array_equal(capped.y_test, whole.y_test[::step])


def test_a_window_reads_the_same_rows_after_reopening(cache):
  def window(w):
    ds = input_pipeline.load("stdlib", {"seq_len": 32, "cache_dir": cache},
                             1, 2)
    shard = input_pipeline.Shard(1, ds.x_train, ds.y_train)
    return input_pipeline.window_batch([shard], w, 2, 2, 4, seed=0)

  first = [window(w) for w in (0, 7)]
  for (x, y), (x2, y2) in zip(first, [window(w) for w in (0, 7)]):
    assert x.dtype == np.uint8 and x.shape == (2, 2, 4, 32)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])


@pytest.mark.parametrize("kwargs,message", [
    ({"seq_len": 0}, "seq_len=0, stride=0 are invalid"),
    ({"stride": 0}, "seq_len=128, stride=0 are invalid"),
    ({"test_fraction": 1.0}, "test_fraction=1.0 is invalid"),
    ({"max_test_windows": 0}, "max_test_windows=0 is invalid"),
    ({"seq_len": 10**9}, "seq_len=1000000000 is invalid"),
    ({"process_index": 2, "process_count": 2}, "process_index=2 is invalid"),
])
def test_bad_values_are_one_line(cache, kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    data.stdlib(cache_dir=cache, **kwargs)
  assert "\n" not in str(e.value) and "valid:" in str(e.value)


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path):
  blocker = tmp_path / "cache"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match=(
      r"^cache_dir='.*cache' is invalid: a file, not a directory; valid: a "
      r"directory \(made if missing\)$")):
    stdlib_corpus.stdlib(64, cache_dir=str(blocker))
