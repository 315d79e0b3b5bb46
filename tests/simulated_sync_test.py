"""A sync policy replaying a simulation of its own run, built from a config.

`sync="simulated"` against the policy built by hand from the same
simulation (the cluster, schedule, stragglers and seed spelled out, as a
user would without the config path), a config row of
`configs/experiments/sync_wallclock.py` run end to end through launch.py,
and one-line refusals of bad arguments.
"""

import ast
import importlib
import json
import pathlib
import runpy
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stalepipe as sp  # pylint: disable=g-import-not-at-top
from stalepipe.train import build  # pylint: disable=g-import-not-at-top
from tests.launching import launch as _launch  # pylint: disable=g-import-not-at-top
from tests.run_path_test import tiny  # pylint: disable=g-import-not-at-top

simulated = importlib.import_module("stalepipe.sync.simulated")
CONFIG = ROOT / "configs" / "experiments" / "sync_wallclock.py"
STEPS = 32  # 4 windows of 8 minibatches
N, S, M = 4, 2, 2


def _row(arg: str, **overrides):
  config = runpy.run_path(str(CONFIG))["get_config"](arg)
  config.update(num_steps=STEPS, **overrides)
  return config


def _by_hand(policy: str, clock_distance: int = 0, **options):
  """The policy replaying a simulated run, every part spelled out (SDPipe
  with `options`)."""
  per_micro = 6 * 4.1e9 * 256 / 15e12 / S / M
  costs = sp.sim.StageCosts.uniform(
      S, per_micro / 3, 2 * per_micro / 3,
      activation_bytes=256 * 512 * 28 * 28 * 4 / M,
      param_bytes=25.6e6 * 4 / S, samples_per_microbatch=256 // M)
  cluster = sp.sim.Cluster.grid(
      N, S, devices_per_node=S, intra=sp.sim.Link(100e9, 5e-6),
      inter=sp.sim.Link(10e9 / 8, 50e-6), ps=sp.sim.Link(10e9 / 8, 50e-6))
  name, kw = (("hetpipe", {"concurrent_minibatches": 4}) if policy == "wsp"
              else ("1f1b", {}))
  run = sp.sim.tile(sp.schedules.make(name, num_stages=S, num_microbatches=M,
                                      num_minibatches=24, **kw), STEPS)
  iteration = sp.sim.simulate(run, cluster, costs).makespan / STEPS
  timed = {"bsp": sp.sim.bsp(), "ad_psgd": sp.sim.ad_psgd(),
           "wsp": sp.sim.wsp(clock_distance, 4),
           "sdpipe": sp.sim.sdpipe(10, iteration / N, **options)}[policy]
  result = sp.sim.simulate(run, cluster, costs, timed,
                           perturbations=(sp.sim.hete("B"),), seed=0)
  numeric = {
      "bsp": lambda: sp.sync.bsp(N),
      "wsp": lambda: sp.sync.wsp(
          N, clock_distance, 4, server="mean",
          delays=simulated.wsp_delays(result, clock_distance)),
      "sdpipe": lambda: sp.sync.sdpipe(
          N, 10, iteration / N,
          ready_times=result.applied_local.transpose(1, 0, 2), **options),
      "ad_psgd": lambda: simulated.Replayed(
          N, simulated.ad_psgd_groups(result)),
  }[policy]()
  return numeric, result.applied[:, 1:].max(axis=(0, 2)), result


@pytest.mark.parametrize("row,policy,distance", [
    ("bsp", "bsp", 0), ("wsp4", "wsp", 4), ("sdpipe", "sdpipe", 0),
    ("ad_psgd", "ad_psgd", 0)])
def test_a_config_builds_the_policy_built_by_hand(row, policy, distance):
  built = build.parts(_row(f"policy={row},stragglers=hete-B")).pipeline.sync
  expected, seconds, result = _by_hand(policy, distance)
  assert type(built) is type(expected)
  np.testing.assert_array_equal(built.trace.seconds, seconds)
  assert built.trace.staleness == result.staleness.mean() / N
  for key, value in expected.plan(0, STEPS, S).items():
    np.testing.assert_array_equal(built.plan(0, STEPS, S)[key], value, key)
  if policy == "wsp":
    np.testing.assert_array_equal(built.delays, expected.delays)
    assert built.delays.max() > 0  # the stragglers made some worker late
  if policy == "sdpipe":
    assert built.window == expected.window
    # The replayed scheduler averages exactly the simulated groups.
    for s in range(S):
      for p in range(STEPS):
        np.testing.assert_array_equal(built.mixing(s, p), sp.sync.group_mixing(
            result.extras["sdpipe_groups"][s][p], N))


@pytest.mark.parametrize("options", [{"min_size": 3},
                                     {"history_unit": "group"}])
def test_sdpipe_replays_the_groups_simulated_with_its_options(options):
  """`min_size` and `history_unit` reach the replaying scheduler: it
  averages exactly the groups the simulation formed with them."""
  config = _row("policy=sdpipe,stragglers=hete-B")
  config.sync_kwargs.policy_kwargs.update(options)
  built = build.parts(config).pipeline.sync
  expected, _, result = _by_hand("sdpipe", **options)
  for key, value in expected.plan(0, STEPS, S).items():
    np.testing.assert_array_equal(built.plan(0, STEPS, S)[key], value, key)
  for s in range(S):
    for p in range(STEPS):
      np.testing.assert_array_equal(built.mixing(s, p), sp.sync.group_mixing(
          result.extras["sdpipe_groups"][s][p], N))


def test_a_config_row_runs_through_launch_and_logs_simulated_seconds(
    tmp_path):
  workdir = tmp_path / "hete-A-sdpipe-0"
  result = _launch(
      "--config=configs/experiments/sync_wallclock.py:policy=sdpipe,"
      "stragglers=hete-A", f"--config.num_steps={STEPS}",
      "--config.model_kwargs.hidden=16", workdir=workdir)
  assert result.returncode == 0, result.stderr[-2000:]
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines()]
  seconds = {r["step"]: r["simulated_seconds"] for r in records
             if "simulated_seconds" in r}
  assert sorted(seconds) == list(range(8, STEPS + 1, 8))
  assert np.all(np.diff([seconds[s] for s in sorted(seconds)]) > 0)
  assert {r["step"] for r in records if "loss" in r} == set(seconds)
  figures = json.loads((workdir / "figures.json").read_text())
  assert figures["simulated_seconds"] == seconds[STEPS]
  assert 0 < figures["replica_mean_test_accuracy"] <= 1


@pytest.mark.parametrize("sync_kwargs,message", [
    ({"policy": "gossip"}, "policy='gossip' is invalid; valid: bsp, wsp, "
     "sdpipe, ad_psgd"),
    ({"policy": "bsp", "stragglers": "hete-C"}, "stragglers='hete-C' is "
     "invalid; valid: homogeneous, hete-A, hete-B"),
    ({"policy": "bsp", "cluster": "v100"}, "cluster='v100' is invalid; "
     "valid: resnet50_10gbe"),
    ({"policy": "wsp", "policy_kwargs": {"clock_distance": -1}},
     "policy_kwargs of 'wsp': clock_distance=-1 is invalid; it must be an "
     "integer >= 0"),
    ({"policy": "sdpipe", "policy_kwargs": {"period": 2}},
     "policy_kwargs of 'sdpipe': sync policy 'sdpipe' takes no 'period'; "
     "valid keys: history, window, ready_times, enforce"),
    ({"policy": "bsp", "delay": 1}, "sync_kwargs.delay"),
    ({}, "sync_kwargs.policy is missing"),
])
def test_bad_arguments_are_one_line(sync_kwargs, message):
  config = tiny(num_replicas=2, sync="simulated", sync_kwargs=sync_kwargs)
  with pytest.raises(ValueError) as e:
    build.parts(config)
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_run_too_long_to_simulate_is_refused_by_arithmetic():
  config = tiny(num_replicas=2, sync="simulated", num_steps=2_000_000,
                sync_kwargs={"policy": "bsp"})
  with pytest.raises(ValueError) as e:
    build.parts(config)
  # 1F1B runs a forward and a backward of every micro-batch on every stage.
  per_step = 2 * 2 * config.num_stages * config.num_microbatches
  most = simulated.MAX_SIMULATED_TASKS // per_step
  assert str(e.value).startswith("num_steps=2000000 is invalid for sync "
                                 "'simulated'") and "\n" not in str(e.value)
  assert f"valid: at most {most} steps" in str(e.value), str(e.value)


def test_the_hook_refuses_a_policy_that_replays_nothing(tmp_path):
  module = runpy.run_path(str(ROOT / "experiments" / "hooks.py"))
  parts = build.parts(tiny(num_replicas=2))
  with pytest.raises(ValueError, match="hook SimulatedSeconds needs "
                     "sync='simulated', not sync='bsp'; valid: "):
    module["SimulatedSeconds"](parts, str(tmp_path))


def test_the_executor_and_the_sync_policies_never_import_the_simulator():
  """Only `simulated`'s factory imports `stalepipe.sim`, inside itself."""
  found = []
  for package in ("pipeline", "sync"):
    for path in sorted((ROOT / "stalepipe" / package).glob("*.py")):
      for node in ast.parse(path.read_text()).body:  # module level only
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}: {n}" for n in names
                  if n.startswith("stalepipe.sim")]
  assert not found, found
