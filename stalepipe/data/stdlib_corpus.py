"""A byte-level language-modelling corpus: the whole Python standard library.

The corpus is every `.py` file under `sysconfig.get_paths()["stdlib"]`, its
`test/` packages included (about 60% of the bytes; without them the corpus
would be a third as large), installed packages (`site-packages`) excluded.
Files are read as bytes in sorted relative-path order; ids are the bytes
themselves, so the vocabulary is all 256 byte values whatever the files
hold. A file is held out for testing when a stable hash of its relative path
falls below `test_fraction`,

.. math::
  \\mathrm{test}(p) \\iff \\mathrm{int}(\\mathrm{sha256}(p)_{0:8}) / 2^{64}
  < \\mathrm{test\\_fraction},

so the split is the same on every machine, and no test window overlaps a
training file. The training files' bytes, then the test files', are
written once to a uint8 `.npy` cache file (named by the Python version, a
hash of the file list with sizes, and `test_fraction`) and memory-mapped:
the windows are strided views on the mapped file, so a batch reads only
the pages of its own rows.

References:
  Radford et al, Language Models are Unsupervised Multitask Learners, 2019
  (§2.2: byte-level input). Karpathy, The Unreasonable Effectiveness of
  Recurrent Neural Networks
  <https://karpathy.github.io/2015/05/21/rnn-effectiveness/>, 2015 (LM on
  source code).
"""

import hashlib
import os
import sys
import sysconfig
import tempfile
from typing import NamedTuple

import numpy as np

from stalepipe.data.chars import window_stride, windows
from stalepipe.data.digits import Dataset, shard

VOCAB_SIZE = 256  # every byte value is an id
_SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")


class Files(NamedTuple):
  """The corpus's files, relative to `root`, in sorted order."""

  root: str
  train: tuple[str, ...]
  test: tuple[str, ...]  # the files `is_test_file(path, test_fraction)`
  sizes: dict[str, int]  # bytes per file
  test_fraction: float


def is_test_file(relative_path: str, test_fraction: float) -> bool:
  """Whether the file at `relative_path` is held out (the hash rule above).

  Examples:
    >>> is_test_file("json/decoder.py", 0.0), is_test_file("x.py", 1.0)
    (False, True)
  """
  digest = hashlib.sha256(relative_path.encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def stdlib_files(test_fraction: float = 0.1, root: str | None = None
                 ) -> Files:
  """The standard library's `.py` files under `root` (the running Python's
  when None), split into training and test files.

  Examples:
    >>> files = stdlib_files()
    >>> "json/decoder.py" in files.train + files.test
    True
  """
  root = sysconfig.get_paths()["stdlib"] if root is None else root
  paths = []
  for directory, subdirs, names in os.walk(root):
    subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
    paths += [os.path.relpath(os.path.join(directory, n), root)
              for n in names if n.endswith(".py")]
  paths.sort()
  sizes = {p: os.path.getsize(os.path.join(root, p)) for p in paths}
  test = tuple(p for p in paths if is_test_file(p, test_fraction))
  held_out = set(test)
  return Files(root, tuple(p for p in paths if p not in held_out), test,
               sizes, test_fraction)


def _cache_path(files: Files, cache_dir: str) -> str:
  """The cache file of `files`: a new name for any other Python, file list,
  file size or split."""
  listing = hashlib.sha256()
  for p in files.train + files.test:
    listing.update(f"{p}\0{files.sizes[p]}\0".encode())
  version = ".".join(map(str, sys.version_info[:3]))
  return os.path.join(
      os.path.expanduser(cache_dir),
      f"stdlib-py{version}-{listing.hexdigest()[:16]}-test"
      f"{files.test_fraction!r}"
      ".npy")


def _write(files: Files, path: str) -> None:
  """Writes the training then the test files' bytes to `path` as a uint8
  `.npy`, atomically: a temporary file in the same directory, synced and
  renamed once complete."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  total = sum(files.sizes.values())
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as out:
      np.lib.format.write_array_header_1_0(
          out, {"descr": "|u1", "fortran_order": False, "shape": (total,)})
      for p in files.train + files.test:
        with open(os.path.join(files.root, p), "rb") as f:
          if out.write(f.read()) != files.sizes[p]:
            raise OSError(f"{p} changed while the corpus was read")
      out.flush()
      os.fsync(out.fileno())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def corpus_bytes(files: Files, cache_dir: str
                 ) -> tuple[np.ndarray, np.ndarray]:
  """The training and test bytes of `files`, uint8 views on the memory-mapped
  cache file in `cache_dir` (written first if missing, or if it is not an
  `.npy` of the files' size)."""
  where = os.path.expanduser(cache_dir)
  if os.path.exists(where) and not os.path.isdir(where):
    raise ValueError(f"cache_dir={cache_dir!r} is invalid: a file, not a "
                     "directory; valid: a directory (made if missing)")
  path = _cache_path(files, cache_dir)
  total = sum(files.sizes.values())
  data = None
  if os.path.exists(path):
    try:
      data = np.load(path, mmap_mode="r")
    except (ValueError, EOFError):  # not an .npy, or cut short
      data = None
  if data is None or data.shape != (total,) or data.dtype != np.uint8:
    _write(files, path)
    data = np.load(path, mmap_mode="r")
  num_train = sum(files.sizes[p] for p in files.train)
  return data[:num_train], data[num_train:]


def stdlib(seq_len: int = 128, *, stride: int | None = None,
           test_fraction: float = 0.1, max_test_windows: int | None = None,
           cache_dir: str = "~/.cache/stalepipe", process_index: int = 0,
           process_count: int = 1) -> Dataset:
  """Windows of `seq_len` bytes of the standard library and their next bytes.

  Window `k` of a split starts at byte `s_k = k * stride` of that split's
  concatenated files: `x = t[s_k : s_k + L]`, `y = t[s_k + 1 : s_k + L + 1]`.
  Every array is a view on the memory-mapped cache file (nothing is read
  until rows are indexed); ids stay uint8, and the models and losses cast
  them to int32.

  Args:
    seq_len: `L`, bytes per window.
    stride: distance between window starts; `seq_len` (disjoint windows)
      when None.
    test_fraction: share of the files held out for testing (by the hash of
      their path, `is_test_file`).
    max_test_windows: at most this many test windows, evenly spaced over the
      test bytes (every `ceil(n / max_test_windows)`-th); all when None.
    cache_dir: directory of the cache file (`~` expanded).
    process_index: this process's index, for multi-host loading.
    process_count: number of processes; each keeps every `process_count`-th
      training window starting at `process_index`. The test set is whole.

  Returns:
    The data set: uint8 tokens `x` [N, L], uint8 next tokens `y` [N, L],
    `num_classes` 256.

  References:
    Radford et al, Language Models are Unsupervised Multitask Learners, 2019.

  Examples:
    >>> import tempfile
    >>> ds = stdlib(64, cache_dir=tempfile.mkdtemp())
    >>> ds.x_train.shape[1], ds.x_train.dtype, ds.num_classes
    (64, dtype('uint8'), 256)
  """
  stride = window_stride(seq_len, stride, test_fraction)
  if max_test_windows is not None and max_test_windows < 1:
    raise ValueError(f"max_test_windows={max_test_windows} is invalid; "
                     "valid: >= 1, or None for all")
  files = stdlib_files(test_fraction)
  train_bytes, test_bytes = corpus_bytes(files, cache_dir)
  train = shard(windows(train_bytes, seq_len, stride), process_index,
                process_count)
  test = windows(test_bytes, seq_len, stride)
  if max_test_windows is not None and len(test) > max_test_windows:
    test = test[::-(-len(test) // max_test_windows)]
  if not len(train) or not len(test):
    raise ValueError(f"seq_len={seq_len} is invalid for {len(train_bytes)} "
                     f"training and {len(test_bytes)} test bytes; valid: "
                     "short enough for a window in both")
  return Dataset(train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:],
                 num_classes=VOCAB_SIZE)
