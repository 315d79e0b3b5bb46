"""Tests for stalepipe.plan against brute force and direct formulas."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stalepipe import models
from stalepipe import plan as sp_plan
from stalepipe.plan import devices as dev

NET = dev.Network(intra_bandwidth=1e3, inter_bandwidth=2e2,
                  intra_latency=1e-3, inter_latency=5e-3)
FAST = dev.DeviceType("F", tflops=4.0, memory_bytes=900, memory_bandwidth=1.0)
SLOW = dev.DeviceType("S", tflops=1.0, memory_bytes=500, memory_bandwidth=1.0)


def random_profile(rng, num_blocks, device="F"):
  forward = rng.uniform(0.1, 1.0, num_blocks)
  return sp_plan.Profile(
      device=device, batch_size=8, forward_s=tuple(forward),
      backward_s=tuple(forward * rng.uniform(1.5, 2.5, num_blocks)),
      param_bytes=tuple(int(v) for v in rng.integers(5, 40, num_blocks)),
      output_bytes=tuple(int(v) for v in rng.integers(10, 300, num_blocks)),
      kept_bytes=tuple(int(v) for v in rng.integers(5, 60, num_blocks)))


def profiles_for(profile):
  return {"F": profile, "S": sp_plan.scale(profile, FAST, SLOW)}


def evaluate(profiles, order, cuts, concurrent, slots=2):
  """Stage times and memory of one plan, written out with plain loops."""
  n = profiles["F"].num_blocks
  ends = list(cuts[1:]) + [n]
  times, memory = [], []
  for s, (d, b, e) in enumerate(zip(order, cuts, ends)):
    p = profiles[d.spec.name]
    t = sum(p.forward_s[j] + p.backward_s[j] for j in range(b, e))
    if s > 0:
      same = order[s - 1].node == d.node
      bw, lat = ((NET.intra_bandwidth, NET.intra_latency) if same
                 else (NET.inter_bandwidth, NET.inter_latency))
      t += lat + p.output_bytes[b - 1] / bw
    if s < len(order) - 1:
      same = order[s + 1].node == d.node
      bw, lat = ((NET.intra_bandwidth, NET.intra_latency) if same
                 else (NET.inter_bandwidth, NET.inter_latency))
      t += lat + p.output_bytes[e - 1] / bw
    in_flight = concurrent - s if concurrent - s > 1 else 1
    params = sum(p.param_bytes[j] for j in range(b, e))
    kept = sum(p.kept_bytes[j] for j in range(b, e))
    times.append(t)
    memory.append(params * (in_flight + slots) + in_flight * kept)
  return times, memory


def brute_force(profiles, devices, concurrent):
  """(best bottleneck, least worst memory shortfall) over all orders, cuts."""
  n = profiles["F"].num_blocks
  best_time, best_short = np.inf, np.inf
  for order in itertools.permutations(devices):
    for inner in itertools.combinations(range(1, n), len(devices) - 1):
      times, memory = evaluate(profiles, order, (0,) + inner, concurrent)
      short = max(m - d.spec.memory_bytes for m, d in zip(memory, order))
      best_short = min(best_short, short)
      if short <= 0:
        best_time = min(best_time, max(times))
  return best_time, best_short


CLUSTERS = {
    "two_types_two_nodes": [dev.Device(FAST, 0, 0), dev.Device(FAST, 0, 1),
                            dev.Device(SLOW, 1, 0), dev.Device(SLOW, 1, 1)],
    "same_type_two_nodes": [dev.Device(FAST, 0, 0), dev.Device(FAST, 1, 0),
                            dev.Device(SLOW, 1, 1)],
    "one_node_mixed": [dev.Device(FAST, 0, 0), dev.Device(SLOW, 0, 1),
                       dev.Device(SLOW, 0, 2)],
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("concurrent", [1, 3])
def test_partition_matches_brute_force(name, seed, concurrent):
  devices = CLUSTERS[name]
  profiles = profiles_for(random_profile(np.random.default_rng(seed), 7))
  best, _ = brute_force(profiles, devices, concurrent)
  if best == np.inf:
    with pytest.raises(sp_plan.InfeasiblePlanError):
      sp_plan.partition(profiles, devices, concurrent=concurrent, network=NET)
    return
  plan = sp_plan.partition(profiles, devices, concurrent=concurrent,
                           network=NET)
  times, memory = evaluate(profiles, plan.devices, plan.boundaries, concurrent)
  assert plan.bottleneck_s == pytest.approx(best, rel=1e-12)
  np.testing.assert_allclose(plan.stage_times, times, rtol=1e-12)
  assert list(plan.memory_bytes) == memory
  assert all(m <= d.spec.memory_bytes for m, d in zip(memory, plan.devices))
  assert sorted(plan.devices) == sorted(devices)
  ends = list(plan.boundaries[1:]) + [7]
  p = profiles["F"]
  assert list(plan.param_bytes) == [sum(p.param_bytes[b:e]) for b, e in
                                    zip(plan.boundaries, ends)]
  assert list(plan.activation_bytes) == [p.output_bytes[e - 1] for e in
                                         ends[:-1]] + [0]


def test_memory_binds_and_moves_the_optimum():
  """Memory limits change the optimum, and the partitioner follows."""
  devices = CLUSTERS["two_types_two_nodes"]
  roomy = [d._replace(spec=d.spec._replace(memory_bytes=10**9))
           for d in devices]
  profiles = profiles_for(random_profile(np.random.default_rng(3), 7))
  free = sp_plan.partition(profiles, roomy, network=NET).bottleneck_s
  slowed = []
  for concurrent in range(1, 8):
    best, _ = brute_force(profiles, devices, concurrent)
    if best == np.inf:
      break
    got = sp_plan.partition(profiles, devices, concurrent=concurrent,
                            network=NET).bottleneck_s
    assert got == pytest.approx(best, rel=1e-12)
    slowed.append(got > free * (1 + 1e-9))
  assert any(slowed), "the case must make memory bind before it runs out"


def test_infeasible_names_device_and_shortfall():
  devices = CLUSTERS["two_types_two_nodes"]
  profiles = profiles_for(random_profile(np.random.default_rng(4), 7))
  concurrent = 12
  best, short = brute_force(profiles, devices, concurrent)
  assert best == np.inf and short > 0
  with pytest.raises(sp_plan.InfeasiblePlanError) as err:
    sp_plan.partition(profiles, devices, concurrent=concurrent, network=NET)
  message = str(err.value)
  assert re.search(r"at best [FS] on node \d", message)
  missing = float(re.search(r"([\d.]+) GiB missing", message).group(1))
  assert missing == pytest.approx(short / dev.GIB, abs=0.005)


@pytest.mark.parametrize("seed", [0, 5])
def test_max_concurrent_is_largest_feasible(seed):
  devices = CLUSTERS["one_node_mixed"]
  profiles = profiles_for(random_profile(np.random.default_rng(seed), 6))
  feasible = [m for m in range(1, 20)
              if brute_force(profiles, devices, m)[0] < np.inf]
  assert feasible, "test case must fit one minibatch"
  got = sp_plan.max_concurrent_minibatches(profiles, devices, network=NET,
                                           limit=19)
  assert got == max(feasible)


def test_bad_inputs_raise():
  profiles = profiles_for(random_profile(np.random.default_rng(0), 3))
  four = CLUSTERS["two_types_two_nodes"]
  with pytest.raises(ValueError, match="4 devices for 3 blocks"):
    sp_plan.partition(profiles, four)
  with pytest.raises(ValueError, match="concurrent=0"):
    sp_plan.partition(profiles, four[:2], concurrent=0)
  with pytest.raises(ValueError, match="no profile for device types"):
    sp_plan.partition({"F": profiles["F"]}, four[:3])


def test_measure_mlp_save_load_and_split(tmp_path):
  blocks = models.mlp(12, 24, 2, 5)
  x = jnp.ones((16, 12))
  profile = sp_plan.measure(blocks, x, repeats=2)
  widths = [12, 24, 24, 5]
  assert profile.param_bytes == tuple(4 * (a * b + b) for a, b in
                                      zip(widths[:-1], widths[1:]))
  assert profile.output_bytes == tuple(4 * 16 * w for w in widths[1:])
  # Residuals hold at least each block's input (needed for the weight grad).
  assert all(k >= 4 * 16 * w for k, w in zip(profile.kept_bytes, widths[:-1]))
  assert min(profile.forward_s) > 0 and min(profile.backward_s) > 0
  path = tmp_path / "mlp.json"
  sp_plan.save(profile, str(path))
  assert sp_plan.load(str(path)) == profile

  cpu = dev.DeviceType(profile.device, 1.0, 10**9, 1.0)
  devices = [dev.Device(cpu, 0, 0), dev.Device(cpu, 0, 1)]
  plan = sp_plan.partition({cpu.name: profile}, devices, concurrent=2)
  staged = models.split(blocks, plan.boundaries)
  assert staged.boundaries == plan.boundaries
  whole = models.split(blocks, 1)
  np.testing.assert_allclose(models.unpipelined(staged)(staged.stage_params, x),
                             whole.stage_fns[0](whole.stage_params[0], x),
                             rtol=1e-6)


def test_scale_by_peak_flops():
  p = random_profile(np.random.default_rng(0), 4)
  q = sp_plan.scale(p, FAST, SLOW)
  np.testing.assert_allclose(q.forward_s, np.array(p.forward_s) * 4.0)
  np.testing.assert_allclose(q.backward_s, np.array(p.backward_s) * 4.0)
  assert (q.param_bytes, q.kept_bytes) == (p.param_bytes, p.kept_bytes)
  # Seed 001 Table 1: peak FP32 = 2 x CUDA cores x boost clock.
  assert dev.TITAN_V.tflops == pytest.approx(2 * 5120 * 1.455e9 / 1e12)
  assert dev.RTX_2060.memory_bytes == 6 * 2**30


def test_allocation_policies_reproduce_table3():
  cluster = sp_plan.Cluster(tuple(sp_plan.Node(dev.TABLE1[t], 4)
                                  for t in "VRGQ"))
  table3 = {"NP": ["VVVV", "RRRR", "GGGG", "QQQQ"],
            "ED": ["VRGQ"] * 4,
            "HD": ["VVQQ", "VVQQ", "RRGG", "RRGG"]}
  for policy, expected in table3.items():
    workers = sp_plan.allocate(cluster, policy)
    assert ["".join(d.spec.name for d in vw) for vw in workers] == expected
    assert sorted(d for vw in workers for d in vw) == sorted(cluster.devices)
  with pytest.raises(ValueError, match="unknown policy"):
    sp_plan.allocate(cluster, "XX")


def test_plan_cluster_uses_min_max_m():
  cluster = sp_plan.Cluster(
      (sp_plan.Node(FAST, 2), sp_plan.Node(SLOW, 2)), network=NET)
  profiles = profiles_for(random_profile(np.random.default_rng(6), 6))
  result = sp_plan.plan_cluster(cluster, "NP", profiles, limit=16)
  expected = [sp_plan.max_concurrent_minibatches(profiles, vw, network=NET,
                                                 limit=16)
              for vw in result.virtual_workers]
  assert list(result.max_concurrent) == expected
  assert result.concurrent == min(expected)
  assert all(p.concurrent == min(expected) for p in result.plans)
