"""What the simulator runs on: devices, links and the per-stage cost model.

A cluster is a grid of devices, `pipelines x stages` (seed 001 §3: a virtual
worker is one pipeline; seed 002 §3: worker `(j, i)` is stage `j` of pipeline
`i`). Every device has a speed (work per second relative to the reference
device the costs were measured on), a memory size and a node. Two devices on
one node talk over the intra-node link (PCIe), devices on different nodes
over the inter-node link (InfiniBand, Ethernet), as in seed 001 §8.1. The
links are the planner's (`stalepipe.plan.Link`, one class), and a device can
be made from the planner's (`Device.of`); `sim.from_plan` builds a whole
cluster from a plan.

The cost model gives, per stage, the forward and backward seconds of one
micro-batch on the reference device, the part of the backward that computes
the weight gradient (what zero-bubble schedules split off), the bytes of the
activation a stage sends to the next (the gradient sent back has the same
size), the bytes of the stage's parameters (what a sync policy moves) and the
optimizer step's seconds.
"""

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from stalepipe.plan import devices as devices_lib
from stalepipe.plan.devices import Link
from stalepipe.schedules import kinds as kinds_lib


@dataclasses.dataclass(frozen=True)
class Device:
  """One accelerator.

  Attributes:
    name: e.g. "V" for a TITAN V (seed 001 §8.1 naming).
    speed: work per second relative to the reference device of the costs.
    memory_bytes: device memory.
    node: the node it sits in.
  """

  name: str = "gpu"
  speed: float = 1.0
  memory_bytes: float = math.inf
  node: int = 0

  def __post_init__(self):
    if not self.speed > 0:
      raise ValueError(f"speed={self.speed!r} of device {self.name!r} is "
                       "invalid; it must be > 0")

  @classmethod
  def of(cls, device: devices_lib.Device, speed: float = 1.0) -> "Device":
    """The simulator's view of a planner's `device` running at `speed`.

    Examples:
      >>> from stalepipe.plan.devices import TITAN_V
      >>> Device.of(devices_lib.Device(TITAN_V, node=2)).node
      2
    """
    return cls(name=device.spec.name, speed=speed,
               memory_bytes=device.spec.memory_bytes, node=device.node)


def ring_allreduce_seconds(num_bytes: float, num_workers: int,
                           link: Link) -> float:
  r"""Ring all-reduce of `num_bytes` among `num_workers` over `link`.

  Reduce-scatter then all-gather, :math:`2(n-1)` steps of :math:`b/n` bytes:

  .. math:: 2\frac{n-1}{n}\frac{b}{\beta} + 2(n-1)\alpha

  References:
    Patarasuk and Yuan, Bandwidth optimal all-reduce algorithms for clusters
    of workstations <https://doi.org/10.1016/j.jpdc.2008.09.002>, 2009

  Examples:
    >>> ring_allreduce_seconds(4e9, 4, Link(bandwidth=1e9, latency=0.0))
    6.0
    >>> ring_allreduce_seconds(4e9, 1, Link(bandwidth=1e9))
    0.0
  """
  n = num_workers
  if n < 1:
    raise ValueError(f"num_workers={n!r} is invalid; it must be >= 1")
  return (2 * (n - 1) / n * num_bytes / link.bandwidth
          + 2 * (n - 1) * link.latency)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Devices `[pipeline][stage]` and the links between them.

  Attributes:
    devices: `devices[i][s]` runs stage `s` of pipeline `i`.
    intra: the link between devices of one node.
    inter: the link between nodes (also what a group of devices spanning
      nodes all-reduces over).
    ps: the link into a parameter server shard (seed 001 §8.1 places one
      shard per node; "ED-local" puts a stage's shard on that stage's node,
      so `ps` is the intra-node link there).
    ps_shared: whether the replicas share one link into a shard, so pushes
      and pulls queue (a remote shard behind one network card), or each has
      its own (ED-local: every GPU's own PCIe lanes to its host).
  """

  devices: tuple[tuple[Device, ...], ...]
  intra: Link = devices_lib.HETPIPE_NETWORK.intra
  inter: Link = devices_lib.HETPIPE_NETWORK.inter
  ps: Link = devices_lib.HETPIPE_NETWORK.inter
  ps_shared: bool = True

  def __post_init__(self):
    widths = {len(row) for row in self.devices}
    if not self.devices or len(widths) != 1 or 0 in widths:
      raise ValueError(f"devices has rows of lengths {sorted(widths)}; it must "
                       "be a non-empty [pipelines][stages] grid")

  @classmethod
  def grid(cls, num_pipelines: int, num_stages: int, *,
           device: Device = Device(), devices_per_node: int | None = None,
           **links) -> "Cluster":
    """`num_pipelines x num_stages` copies of `device`, pipeline-major on nodes.

    Examples:
      >>> c = Cluster.grid(2, 4, devices_per_node=4)
      >>> [d.node for row in c.devices for d in row]
      [0, 0, 0, 0, 1, 1, 1, 1]
    """
    per_node = devices_per_node or num_pipelines * num_stages
    rows = tuple(
        tuple(dataclasses.replace(device, node=(i * num_stages + s) // per_node)
              for s in range(num_stages)) for i in range(num_pipelines))
    return cls(rows, **links)

  @property
  def num_pipelines(self) -> int:
    return len(self.devices)

  @property
  def num_stages(self) -> int:
    return len(self.devices[0])

  @property
  def speed(self) -> np.ndarray:
    """`[pipelines, stages]` device speeds."""
    return np.array([[d.speed for d in row] for row in self.devices])

  def link(self, a: Device, b: Device) -> Link:
    return self.intra if a.node == b.node else self.inter

  @functools.cached_property
  def nodes(self) -> np.ndarray:
    """`[pipelines, stages]` the node of each device."""
    return np.array([[d.node for d in row] for row in self.devices])

  def group_link(self, stage: int, pipelines: Sequence[int]) -> Link:
    """The (slowest) link a group of one stage's devices all-reduces over."""
    nodes = self.nodes[np.asarray(pipelines), stage]
    return self.intra if nodes.min() == nodes.max() else self.inter


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """Per-stage costs on the reference device (speed 1).

  Attributes:
    forward: seconds of one micro-batch's forward, per stage.
    backward: seconds of one micro-batch's whole backward, per stage.
    weight_gradient: the part of `backward` that computes the weight gradient,
      per stage, in `[0, backward]` (default 0). An unsplit backward ("B")
      costs `backward`; split, its input-gradient task ("BI") costs
      `backward - weight_gradient` and its weight-gradient task ("BW")
      `weight_gradient` (Qi et al, ICLR 2024, §2.3: T_B and T_W). Zero-bubble
      papers' unit costs T_F = T_B = T_W = 1 are `forward=1, backward=2,
      weight_gradient=1`.
    activation_bytes: bytes stage `s` sends to stage `s+1` per micro-batch
      (the last entry, the loss side, is ignored).
    param_bytes: bytes of each stage's parameters (what syncs move).
    update: seconds of one optimizer step, per stage.
    samples_per_microbatch: samples in one micro-batch (for samples/s).
  """

  forward: tuple[float, ...]
  backward: tuple[float, ...]
  weight_gradient: tuple[float, ...] = ()
  activation_bytes: tuple[float, ...] = ()
  param_bytes: tuple[float, ...] = ()
  update: tuple[float, ...] = ()
  samples_per_microbatch: int = 1

  def __post_init__(self):
    S = len(self.forward)
    for name in ("backward", "weight_gradient", "activation_bytes",
                 "param_bytes", "update"):
      value = getattr(self, name)
      if not value:
        object.__setattr__(self, name, (0.0,) * S)
      elif len(value) != S:
        raise ValueError(f"{name} has {len(value)} entries; it must have one "
                         f"per stage ({S})")
    if min(self.forward + self.backward + self.update) < 0:
      raise ValueError("forward, backward and update seconds must be >= 0")
    for s, (w, b) in enumerate(zip(self.weight_gradient, self.backward)):
      if not 0 <= w <= b:
        raise ValueError(f"weight_gradient={w!r} of stage {s} is invalid; it "
                         f"must be in [0, backward={b!r}]")

  @classmethod
  def uniform(cls, num_stages: int, forward: float = 1.0,
              backward: float = 1.0, **kwargs) -> "StageCosts":
    """The same costs on every stage; scalar `kwargs` are repeated too.

    Examples:
      >>> c = StageCosts.uniform(2, forward=1.0, backward=2.0, param_bytes=8)
      >>> c.param_bytes
      (8, 8)
    """
    per_stage = {k: (v,) * num_stages if np.isscalar(v) and
                 k != "samples_per_microbatch" else v
                 for k, v in kwargs.items()}
    return cls(forward=(forward,) * num_stages,
               backward=(backward,) * num_stages, **per_stage)

  @property
  def num_stages(self) -> int:
    return len(self.forward)

  def seconds(self, kind: kinds_lib.TaskKind, stage: int) -> float:
    """Seconds of one micro-batch's task of `kind` on `stage`.

    Asks the kind what it computes: the forward if it produces the output,
    the input-gradient part of the backward if it produces the input
    cotangent, the weight-gradient part if it produces the weight gradient.

    Examples:
      >>> c = StageCosts.uniform(1, forward=1.0, backward=3.0,
      ...                        weight_gradient=1.0)
      >>> [c.seconds(kinds_lib.kind(k), 0) for k in ("F", "B", "BI", "BW")]
      [1.0, 3.0, 2.0, 1.0]
    """
    out = 0.0
    if kind.runs_forward:
      out += self.forward[stage]
    if kinds_lib.INPUT_COTANGENT in kind.produces:
      out += self.backward[stage] - self.weight_gradient[stage]
    if kinds_lib.WEIGHT_GRADIENT in kind.produces:
      out += self.weight_gradient[stage]
    return out
