"""Which stage sits on which device: a placement, as data.

An S-stage schedule runs on a mesh whose 'stage' axis has P devices, P
dividing S; each device holds F = S / P stages in local slots 0..F-1. Folded
(a stage-level schedule), a device runs all of them in every tick; in a
device-level schedule (`Schedule.placement`: interleaved 1F1B, ZB-V,
DualPipeV) it runs at most one of them per tick. The schedule alone decides
the numerics (which weight version each task reads); the placement decides
only where a stage's rings, buffers and tasks live, so every placement trains
the same weights.
A placement is the table `stages[d, j]`, the stage in slot j of device d:

- "consecutive": device d holds stages dF .. dF + F - 1 (folding; P = S is
  one stage per device, P = 1 the whole pipeline on one device);
- "loop": stage s on device s mod P, slot s // P (Interleaved 1F1B,
  Narayanan et al. 2021 §2.2; MaxText's circular pipeline);
- "v": the zig-zag: stage s = kP + i, on leg k = s // P, sits on device i
  where k is even and P - 1 - i where k is odd, slot k (JaxPP's
  `divmod(s, P)`). With two legs (F = 2) device r holds stages r and
  2P - 1 - r (ZB-V, Qi et al. 2024 §6; DualPipeV); torch's
  `generate_stage_to_rank_mapping` and JaxPP's `get_mpmd_idx` use these
  formulas.

A stage's output goes to stage s + 1, which may sit in another slot of the
same device, on the next device, or (loop, v) wrap around or run backwards
along 'stage'. `hops` groups the sends by (source slot, destination slot),
so each group is one `ppermute` (or a copy within the device).

Examples:
  >>> make("consecutive", 4, 2).stages.tolist()
  [[0, 1], [2, 3]]
  >>> make("loop", 4, 2).stages.tolist()
  [[0, 2], [1, 3]]
  >>> make("v", 4, 2).stages.tolist()
  [[0, 3], [1, 2]]
  >>> make("v", 6, 2).stages.tolist()
  [[0, 3, 4], [1, 2, 5]]
"""

from typing import NamedTuple

import numpy as np

from stalepipe import registry


class Hop(NamedTuple):
  """The sends from the stages in slot `source` to those in slot `dest`."""

  source: int  # slot of the sending stages
  dest: int  # slot of the receiving stages
  pairs: tuple[tuple[int, int, int], ...]  # (sending device, receiving
  #   device, receiving stage); a device sends at most once, receives once

  def local(self) -> tuple[int, ...]:
    """The devices where the receiver sits on the sender's device."""
    return tuple(e for d, e, _ in self.pairs if d == e)

  def remote(self) -> tuple[tuple[int, int, int], ...]:
    """The pairs that cross devices (a `ppermute`)."""
    return tuple(p for p in self.pairs if p[0] != p[1])


class Placement(NamedTuple):
  """Stage `stages[d, j]` sits in slot j of device d on 'stage'."""

  name: str
  stages: np.ndarray  # int [P, F]

  @property
  def num_devices(self) -> int:
    return self.stages.shape[0]

  @property
  def num_slots(self) -> int:
    return self.stages.shape[1]

  @property
  def num_stages(self) -> int:
    return self.stages.size

  def where(self, stage: int) -> tuple[int, int]:
    """(device, slot) of `stage`."""
    d, j = np.argwhere(self.stages == stage)[0]
    return int(d), int(j)

  def hops(self, step: int) -> tuple[Hop, ...]:
    """The sends of every stage s to stage s + `step` (1: activations, -1:
    cotangents), grouped by (source slot, destination slot)."""
    groups = {}
    for d in range(self.num_devices):
      for j in range(self.num_slots):
        target = int(self.stages[d, j]) + step
        if 0 <= target < self.num_stages:
          e, k = self.where(target)
          groups.setdefault((j, k), []).append((d, e, target))
    return tuple(Hop(j, k, tuple(pairs))
                 for (j, k), pairs in sorted(groups.items()))


def _check(num_stages: int, num_devices: int):
  if num_devices < 1 or num_stages % num_devices:
    raise ValueError(f"{num_devices} devices on 'stage' is invalid for "
                     f"{num_stages} stages; valid: a divisor of {num_stages}")


def consecutive(num_stages: int, num_devices: int) -> Placement:
  """Device d holds stages dF .. dF + F - 1 (F = S / P)."""
  _check(num_stages, num_devices)
  return Placement("consecutive", np.arange(num_stages).reshape(
      num_devices, -1))


def loop(num_stages: int, num_devices: int) -> Placement:
  """Stage s on device s mod P, slot s // P."""
  _check(num_stages, num_devices)
  return Placement("loop", np.arange(num_stages).reshape(-1, num_devices).T)


def v(num_stages: int, num_devices: int) -> Placement:
  """The zig-zag of S / P legs: slot k of device r holds stage kP + r on an
  even leg, kP + P - 1 - r on an odd one (S = 2P: stages r and 2P - 1 - r)."""
  _check(num_stages, num_devices)
  P, r = num_devices, np.arange(num_devices)
  return Placement("v", np.stack(
      [k * P + (r if k % 2 == 0 else P - 1 - r)
       for k in range(num_stages // P)], axis=1))


PARTS = registry.Registry(
    "placement", {"consecutive": consecutive, "loop": loop, "v": v},
    filled=("num_stages", "num_devices"))


def names() -> tuple[str, ...]:
  """The placements `make` accepts."""
  return PARTS.names()


def make(name: str, num_stages: int, num_devices: int) -> Placement:
  """The placement `name` of `num_stages` stages on `num_devices` devices."""
  return PARTS.make(name, num_stages=num_stages, num_devices=num_devices)


def for_schedule(schedule, num_devices: int,
                 name: str | None = None) -> Placement:
  """Where `schedule`'s stages sit on `num_devices` devices of 'stage'.

  A stage-level schedule takes the placement `name` (default
  "consecutive"). A device-level schedule (`schedule.placement` set) runs
  on its own placement: on its P devices, or folded where every device
  still holds whole devices of it, so the numerics are the schedule's:
  all on one device, or (loop) on P' devices, P' dividing P, device d'
  then holding the chunks of devices d' mod P'.

  Raises:
    ValueError: in one line, where `name` is not the schedule's or the
      devices do not fold its placement.
  """
  own = schedule.placement
  if own is None:
    return make(name or "consecutive", schedule.num_stages, num_devices)
  if name not in (None, own):
    raise ValueError(f"placement={name!r} is invalid for {schedule.name!r}, "
                     f"a device-level schedule on the {own!r} placement; "
                     f"valid: {own!r} (or none: the schedule's)")
  P = schedule.num_devices
  if num_devices == P:
    return make(own, schedule.num_stages, P)
  if num_devices == 1:
    return make("consecutive", schedule.num_stages, 1)
  if own == "loop" and P % num_devices == 0:
    return make("loop", schedule.num_stages, num_devices)
  folds = "1 or a divisor of P" if own == "loop" else "1"
  raise ValueError(f"{num_devices} devices on 'stage' is invalid for "
                   f"{schedule.name!r} on {P} devices ({own} placement); "
                   f"valid: {P}, or {folds} (folded)")
