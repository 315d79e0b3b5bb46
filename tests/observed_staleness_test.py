"""`ObservedStaleness` builds the stream only as far as the run has read."""

import numpy as np
import pytest

import stalepipe as sp


@pytest.mark.parametrize("name,kwargs,policy", [
    ("pipedream", {}, lambda: sp.sync.bsp(2)),
    ("hetpipe", {"concurrent_minibatches": 2}, lambda: sp.sync.wsp(2, 1, 2)),
])
def test_lazy_values_equal_the_whole_stream_and_build_only_what_is_read(
    name, kwargs, policy):
  schedule = sp.schedules.make(name, num_stages=3, num_microbatches=2,
                               **kwargs)
  total = 300
  whole = sp.sync.observed_staleness(schedule, policy(), total)
  lazy = sp.sync.ObservedStaleness(schedule, policy(), total, first=16)
  assert lazy.built == 0
  np.testing.assert_array_equal(lazy[:, 0:4], whole[:, 0:4])
  assert lazy.built == 16  # not the whole run
  np.testing.assert_array_equal(lazy[:, 30:40], whole[:, 30:40])
  assert lazy.built == 64  # doubled until it reached minibatch 40
  np.testing.assert_array_equal(lazy[:, 290:300], whole[:, 290:300])
  assert lazy.built == total  # never past the run
  np.testing.assert_array_equal(lazy[:, 0:total], whole)
