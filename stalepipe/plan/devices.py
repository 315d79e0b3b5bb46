"""Device types, devices and the network between them (seed 001 Table 1, §8.1).

A `DeviceType` is what a profile is scaled by: peak FP32 throughput and memory.
A `Device` is one GPU of a cluster: its type and the node it sits in. Devices
on one node talk over PCIe, devices on different nodes over InfiniBand
(`Network`), as in HetPipe's cluster (seed 001 §8.1).
"""

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


class Network(NamedTuple):
  """Link speeds: within a node (PCIe) and across nodes (InfiniBand).

  A transfer of `n` bytes takes `latency + n / bandwidth` seconds.
  """

  intra_bandwidth: float  # bytes per second between devices of one node
  inter_bandwidth: float  # bytes per second between nodes
  intra_latency: float = 10e-6  # seconds
  inter_latency: float = 20e-6  # seconds

  def seconds(self, num_bytes: float, same_node: bool) -> float:
    """Time to move `num_bytes` between two devices."""
    if same_node:
      return self.intra_latency + num_bytes / self.intra_bandwidth
    return self.inter_latency + num_bytes / self.inter_bandwidth


# Seed 001 §8.1: PCIe 3.0 x16 (15.75 GB/s) in a node, 56 Gb/s InfiniBand across.
HETPIPE_NETWORK = Network(intra_bandwidth=15.75e9, inter_bandwidth=56e9 / 8)
