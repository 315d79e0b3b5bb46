"""Test setup: 8 emulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# Variants that run in the slow suite only: each is a heavier sibling of a
# case the quick suite keeps (named after the arrow), so the quick suite
# still covers every schedule, update rule and sync policy once.
SLOW_VARIANTS = {
    # S=4 of every schedule; quick: S=2 of all, S=4 of pipedream and zb-h1.
    "tests/executor_test.py::test_executor_equals_reference[4-gpipe]",
    "tests/executor_test.py::test_executor_equals_reference[4-1f1b]",
    "tests/executor_test.py::test_executor_equals_reference[4-2bw]",
    "tests/executor_test.py::test_executor_equals_reference[4-hetpipe]",
    "tests/executor_test.py::test_executor_equals_reference[4-timeprest]",
    "tests/executor_test.py::test_executor_equals_reference[4-zb-h2]",
    "tests/executor_test.py::test_executor_equals_reference[4-zb-async]",
    # -> gpipe, pipedream, zb-h1 (flush, asynchronous, split backward).
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[1f1b]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[2bw]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[hetpipe]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[zb-h2]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[zb-async]",
    # -> hetpipe (WSP) and pipedream.
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[hetpipe-<lambda>1]",
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[1f1b-<lambda>]",
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[timeprest-<lambda>]",
    # -> [2-boundaries1].
    "tests/gpipe_executor_test.py::test_gpipe_equals_unpipelined_sgd[2-boundaries2]",
    "tests/gpipe_executor_test.py::test_gpipe_equals_unpipelined_sgd[1-boundaries3]",
    # -> wp1 with a sync policy; pipemare and spectrain alone stay quick.
    "tests/executor_update_rules_test.py::test_update_rule_with_a_sync_policy_executor_equals_oracle[pipemare-hetpipe-options0-<lambda>-2]",
    "tests/executor_update_rules_test.py::test_update_rule_with_a_sync_policy_executor_equals_oracle[spectrain-pipedream-options1-<lambda>-4-1]",
    # -> faults_test's bounded retention and run_path_test's step names.
    "tests/checkpoint_test.py::test_keeps_the_last_n_checkpoints",
}


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.nodeid in SLOW_VARIANTS:
      item.add_marker(pytest.mark.slow)
