"""The hardware vocabulary: device types, devices, links, networks.

One description of a cluster serves the planner (`stalepipe.plan`) and the
simulator (`stalepipe.sim`, which takes a plan with `sim.from_plan`):

- a `DeviceType` is what a profile is scaled by: peak FP32 throughput and
  memory (seed 001 Table 1: `TABLE1`);
- a `Device` is one GPU of a cluster: its type, its node and its slot there;
- a `Link` moves `n` bytes in `latency + n / bandwidth` seconds;
- a `Network` is the link within a node (PCIe) and the link between nodes
  (InfiniBand), as in HetPipe's cluster (seed 001 §8.1: `HETPIPE_NETWORK`).
"""

import dataclasses
from typing import NamedTuple

GIB = 2**30


class DeviceType(NamedTuple):
  """A kind of accelerator.

  Attributes:
    name: short name, e.g. "V" for TITAN V (seed 001 §8.1 naming).
    tflops: peak FP32 throughput in TFLOPS (CUDA cores x boost clock x 2).
    memory_bytes: device memory.
    memory_bandwidth: device memory bandwidth in bytes per second.
  """

  name: str
  tflops: float
  memory_bytes: int
  memory_bandwidth: float


def _table1(name: str, cuda_cores: int, boost_mhz: float, memory_gb: int,
            bandwidth_gbs: float) -> DeviceType:
  return DeviceType(name=name, tflops=2 * cuda_cores * boost_mhz * 1e6 / 1e12,
                    memory_bytes=memory_gb * GIB,
                    memory_bandwidth=bandwidth_gbs * 1e9)


# Seed 001 Table 1: CUDA cores, boost clock (MHz), memory (GB), bandwidth (GB/s).
TITAN_V = _table1("V", 5120, 1455, 12, 653)
TITAN_RTX = _table1("R", 4608, 1770, 24, 672)
RTX_2060 = _table1("G", 1920, 1680, 6, 336)
QUADRO_P4000 = _table1("Q", 1792, 1480, 8, 243)
TABLE1 = {t.name: t for t in (TITAN_V, TITAN_RTX, RTX_2060, QUADRO_P4000)}


class Device(NamedTuple):
  """One accelerator of a cluster: its type, node and slot in the node."""

  spec: DeviceType
  node: int = 0
  slot: int = 0

  @property
  def name(self) -> str:
    return f"{self.spec.name}{self.node}.{self.slot}"


@dataclasses.dataclass(frozen=True)
class Link:
  r"""A network link: moving :math:`n` bytes takes :math:`\alpha + n/\beta`.

  Attributes:
    bandwidth: :math:`\beta`, bytes per second.
    latency: :math:`\alpha`, seconds per message.

  Examples:
    >>> Link(bandwidth=1e9, latency=1e-3).seconds(2e9)
    2.001
  """

  bandwidth: float
  latency: float = 0.0

  def __post_init__(self):
    if not self.bandwidth > 0:
      raise ValueError(f"bandwidth={self.bandwidth!r} is invalid; it must be "
                       "> 0 bytes/s")
    if not self.latency >= 0:
      raise ValueError(f"latency={self.latency!r} is invalid; it must be >= 0")

  def seconds(self, num_bytes: float) -> float:
    return self.latency + num_bytes / self.bandwidth


class Network(NamedTuple):
  """Link speeds: within a node (PCIe) and across nodes (InfiniBand).

  A transfer of `n` bytes takes `latency + n / bandwidth` seconds.

  Examples:
    >>> HETPIPE_NETWORK.inter
    Link(bandwidth=7000000000.0, latency=2e-05)
    >>> Network.of(Link(1e9), Link(1e8, 1e-3)).inter_latency
    0.001
  """

  intra_bandwidth: float  # bytes per second between devices of one node
  inter_bandwidth: float  # bytes per second between nodes
  intra_latency: float = 10e-6  # seconds
  inter_latency: float = 20e-6  # seconds

  @classmethod
  def of(cls, intra: Link, inter: Link) -> "Network":
    """The network whose links are `intra` (in a node) and `inter`."""
    return cls(intra.bandwidth, inter.bandwidth, intra.latency, inter.latency)

  @property
  def intra(self) -> Link:
    """The link between devices of one node."""
    return Link(self.intra_bandwidth, self.intra_latency)

  @property
  def inter(self) -> Link:
    """The link between nodes."""
    return Link(self.inter_bandwidth, self.inter_latency)

  def seconds(self, num_bytes: float, same_node: bool) -> float:
    """Time to move `num_bytes` between two devices."""
    if same_node:
      return self.intra_latency + num_bytes / self.intra_bandwidth
    return self.inter_latency + num_bytes / self.inter_bandwidth


# Seed 001 §8.1: PCIe 3.0 x16 (15.75 GB/s) in a node, 56 Gb/s InfiniBand across.
HETPIPE_NETWORK = Network(intra_bandwidth=15.75e9, inter_bandwidth=56e9 / 8)
