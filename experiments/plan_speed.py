"""Times the partitioner on a 150-block model over 16 devices of 4 types.

Target (issue 7): under 10 s. Run:

  .venv/bin/python experiments/plan_speed.py [--out_dir=DIR]
"""

import time

import numpy as np

import harness
from stalepipe.plan import devices as dev
from stalepipe.plan.partition import max_concurrent_minibatches, partition
from stalepipe.plan.profile import Profile, scale


def synthetic_profile(num_blocks: int, seed: int = 0) -> Profile:
  """A 150-block model on a TITAN V with uneven layer costs and sizes."""
  rng = np.random.default_rng(seed)
  forward = rng.uniform(1e-3, 6e-3, num_blocks)
  return Profile(
      device="V", batch_size=32, forward_s=tuple(forward),
      backward_s=tuple(2 * forward),
      param_bytes=tuple(int(b) for b in rng.integers(1, 40, num_blocks) * 2**20),
      output_bytes=tuple(int(b) for b in rng.integers(1, 50, num_blocks) * 2**20),
      kept_bytes=tuple(int(b) for b in rng.integers(5, 60, num_blocks) * 2**20))


def main(argv):
  del argv
  profile = synthetic_profile(150)
  profiles = {t.name: scale(profile, dev.TITAN_V, t)
              for t in dev.TABLE1.values()}
  devices = [dev.Device(t, node, slot)
             for node, t in enumerate(dev.TABLE1.values()) for slot in range(4)]
  start = time.perf_counter()
  plan = partition(profiles, devices, concurrent=4)
  seconds = time.perf_counter() - start
  print(f"partition: 150 blocks x 16 devices (4 types x 4), N_m=4: "
        f"{seconds:.2f} s")
  print(f"  order {''.join(d.spec.name for d in plan.devices)}, "
        f"boundaries {plan.boundaries}")
  print(f"  bottleneck {plan.bottleneck_s * 1e3:.1f} ms per minibatch")
  start = time.perf_counter()
  max_m = max_concurrent_minibatches(profiles, devices, limit=32)
  max_m_seconds = time.perf_counter() - start
  print(f"Max_m = {max_m} in {max_m_seconds:.2f} s")
  harness.record("plan_speed", {
      "partition_s": seconds,
      "order": "".join(d.spec.name for d in plan.devices),
      "boundaries": list(plan.boundaries), "bottleneck_s": plan.bottleneck_s,
      "max_concurrent": max_m, "max_concurrent_s": max_m_seconds})


if __name__ == "__main__":
  harness.run(main)
