"""Input: replica shards partition the data; windows walk seeded epochs."""

import numpy as np
import pytest

from stalepipe import data
from stalepipe.train import input_pipeline


def test_replica_shards_partition_the_training_set():
  whole = data.digits()
  shards = [input_pipeline.load("digits", {}, r, 3) for r in range(3)]
  rows = np.concatenate([s.x_train for s in shards])
  assert len(rows) == len(whole.x_train)
  # Same multiset of rows: sort both lexicographically.
  key = lambda x: x[np.lexsort(x.T[::-1])]
  np.testing.assert_array_equal(key(rows), key(whole.x_train))
  np.testing.assert_array_equal(shards[1].x_train, whole.x_train[1::3])


def test_each_epoch_is_a_permutation_of_the_shard():
  n, need = 23, 5
  per_epoch = n // need
  for epoch in range(3):
    rows = np.concatenate([input_pipeline.window_rows(w, n, need, 7, 2)
                           for w in range(epoch * per_epoch,
                                          (epoch + 1) * per_epoch)])
    assert len(set(rows.tolist())) == len(rows) == per_epoch * need
    assert rows.min() >= 0 and rows.max() < n


def test_window_rows_depend_on_seed_replica_and_window_only():
  a = input_pipeline.window_rows(9, 100, 10, 0, 1)
  np.testing.assert_array_equal(a, input_pipeline.window_rows(9, 100, 10, 0, 1))
  assert not np.array_equal(a, input_pipeline.window_rows(9, 100, 10, 0, 0))
  assert not np.array_equal(a, input_pipeline.window_rows(9, 100, 10, 1, 1))
  want = np.random.default_rng([0, 1, 0]).permutation(100)[90:100]
  np.testing.assert_array_equal(a, want)


def test_window_batch_puts_replicas_side_by_side():
  shards = [input_pipeline.Shard(r, np.arange(40)[r::2, None] * 1.0,
                                 np.arange(40)[r::2]) for r in range(2)]
  x, y = input_pipeline.window_batch(shards, 0, 2, 3, 2, seed=0)
  assert x.shape == (2, 3, 4, 1) and y.shape == (2, 3, 4)
  # Columns 0-1 come from replica 0 (even rows), 2-3 from replica 1 (odd).
  assert np.all(y[:, :, :2] % 2 == 0) and np.all(y[:, :, 2:] % 2 == 1)
  np.testing.assert_array_equal(x[..., 0], y)
  rows = input_pipeline.window_rows(0, 20, 12, 0, 1)
  np.testing.assert_array_equal(y[:, :, 2:].ravel(), (2 * rows + 1))


def test_global_batch_is_independent_of_the_process_count():
  """One process with both replicas == two processes with one each."""
  shards = [input_pipeline.Shard(r, *input_pipeline.load("digits", {}, r,
                                                         2)[:2])
            for r in range(2)]
  whole = input_pipeline.window_batch(shards, 5, 2, 2, 3, seed=1)
  parts = [input_pipeline.window_batch([s], 5, 2, 2, 3, seed=1)
           for s in shards]
  for i in range(2):
    np.testing.assert_array_equal(
        whole[i], np.concatenate([p[i] for p in parts], axis=2))


@pytest.mark.parametrize("name,kwargs,match", [
    ("nope", {}, "unknown dataset 'nope'; valid: digits"),
    ("digits", {"size": 3}, "dataset 'digits' takes no 'size'; valid keys: "),
])
def test_bad_dataset_is_rejected(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    input_pipeline.load(name, kwargs, 0, 1)


def test_bad_input_shape_and_small_shard_are_rejected():
  with pytest.raises(ValueError, match=r"input_shape \(3, 3\) is invalid"):
    input_pipeline.load("digits", {}, 0, 1, (3, 3))
  with pytest.raises(ValueError, match="a window needs 50 examples per data "
                     "replica but a replica's shard has 10"):
    input_pipeline.window_rows(0, 10, 50, 0, 0)
