"""Allocating a heterogeneous cluster to virtual workers (seed 001 §8.1, Table 3).

HetPipe groups the GPUs of a cluster into virtual workers (VWs) of k GPUs
each, partitions the model over each VW, and runs every VW with the same
number of concurrent minibatches, :math:`N_m = \\min_{VW} Max_m` (seed 001
§4). Three allocation policies (seed 001 §8.1):

- NP, node partition: one node per VW (homogeneous VWs, PCIe links only).
- ED, equal distribution: every VW gets the same share of every node.
- HD, hybrid distribution: nodes are paired so that the pairs' aggregate
  compute and memory are alike, and each VW takes half of each node of a pair
  (seed 001's VVQQ / RRGG).
"""

import math
from typing import Mapping, NamedTuple, Sequence

from stalepipe.plan.devices import HETPIPE_NETWORK, Device, DeviceType, Network
from stalepipe.plan.partition import Plan, max_concurrent_minibatches, partition
from stalepipe.plan.profile import Profile

POLICIES = ("NP", "ED", "HD")


class Node(NamedTuple):
  """`count` devices of one type in one machine."""

  spec: DeviceType
  count: int


class Cluster(NamedTuple):
  """Nodes of homogeneous devices and the network between them."""

  nodes: tuple[Node, ...]
  network: Network = HETPIPE_NETWORK

  @property
  def devices(self) -> tuple[Device, ...]:
    return tuple(Device(node.spec, i, slot)
                 for i, node in enumerate(self.nodes)
                 for slot in range(node.count))


def _shares(cluster: Cluster, node: int, parts: int) -> list[list[Device]]:
  count = cluster.nodes[node].count
  if count % parts:
    raise ValueError(f"node {node} has {count} devices, which do not split "
                     f"into {parts} equal shares; valid: a multiple of {parts}")
  size = count // parts
  return [[Device(cluster.nodes[node].spec, node, slot)
           for slot in range(j * size, (j + 1) * size)] for j in range(parts)]


def _spread(groups: Sequence[Sequence[int]],
            cluster: Cluster) -> float:
  """Largest relative spread of aggregate TFLOPS and memory across groups."""
  worst = 0.0
  for measure in (lambda s: s.tflops, lambda s: s.memory_bytes):
    totals = [sum(measure(cluster.nodes[i].spec) * cluster.nodes[i].count
                  for i in g) for g in groups]
    worst = max(worst, (max(totals) - min(totals)) / max(totals))
  return worst


def _pairings(items: Sequence[int]):
  if not items:
    yield []
    return
  first, rest = items[0], items[1:]
  for j, other in enumerate(rest):
    for tail in _pairings(rest[:j] + rest[j + 1:]):
      yield [(first, other)] + tail


def allocate(cluster: Cluster, policy: str,
             num_virtual_workers: int | None = None
             ) -> tuple[tuple[Device, ...], ...]:
  """Groups a cluster's devices into virtual workers by `policy`.

  Args:
    cluster: the nodes.
    policy: "NP" (one node per VW), "ED" (every VW an equal share of every
      node) or "HD" (nodes paired by balanced aggregate compute and memory;
      each VW takes half of each node of one pair).
    num_virtual_workers: for ED only, how many VWs share the nodes; defaults
      to the devices per node (one device of each node per VW, as in seed
      001 Table 3). NP and HD fix it.

  Returns:
    The devices of each virtual worker.

  References:
    Park et al, HetPipe, 2020, §8.1 and Table 3.

  Examples:
    >>> from stalepipe.plan.devices import TABLE1
    >>> cluster = Cluster(tuple(Node(TABLE1[t], 4) for t in "VRGQ"))
    >>> ["".join(d.spec.name for d in vw) for vw in allocate(cluster, "HD")]
    ['VVQQ', 'VVQQ', 'RRGG', 'RRGG']
  """
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
  if num_virtual_workers is not None and policy != "ED":
    raise ValueError(f"num_virtual_workers={num_virtual_workers} is only for "
                     f"ED, not {policy}; valid: None")
  num_nodes = len(cluster.nodes)
  if policy == "NP":
    return tuple(tuple(share) for i in range(num_nodes)
                 for share in _shares(cluster, i, 1))
  if policy == "ED":
    parts = num_virtual_workers or math.gcd(*(n.count for n in cluster.nodes))
    shares = [_shares(cluster, i, parts) for i in range(num_nodes)]
    return tuple(tuple(d for node in shares for d in node[j])
                 for j in range(parts))
  if num_nodes % 2:
    raise ValueError(f"HD pairs nodes, but the cluster has {num_nodes}; "
                     "valid: an even number of nodes")
  pairs = min(_pairings(list(range(num_nodes))),
              key=lambda ps: _spread(ps, cluster))
  workers = []
  for a, b in pairs:
    workers += [tuple(x + y) for x, y in zip(_shares(cluster, a, 2),
                                             _shares(cluster, b, 2))]
  return tuple(workers)


class ClusterPlan(NamedTuple):
  """Virtual workers, their partitions and the shared :math:`N_m`."""

  virtual_workers: tuple[tuple[Device, ...], ...]
  max_concurrent: tuple[int, ...]  # Max_m of each virtual worker
  concurrent: int  # N_m = min Max_m, used by every virtual worker
  plans: tuple[Plan, ...]  # each virtual worker's partition at N_m


def concurrent_minibatches(max_concurrent: Sequence[int]) -> int:
  """:math:`N_m = \\min_{VW} Max_m` (seed 001 §4).

  Examples:
    >>> concurrent_minibatches([5, 3, 8])
    3
  """
  if not max_concurrent or min(max_concurrent) < 1:
    raise ValueError(f"max_concurrent={list(max_concurrent)} is invalid; "
                     "valid: a non-empty list of integers >= 1")
  return min(max_concurrent)


def plan_cluster(cluster: Cluster, policy: str,
                 profiles: Mapping[str, Profile], *,
                 concurrent: int | None = None, optimizer_slots: int = 2,
                 limit: int = 64,
                 num_virtual_workers: int | None = None) -> ClusterPlan:
  """Allocates, finds each VW's :math:`Max_m` and partitions at :math:`N_m`.

  Args:
    cluster: the nodes.
    policy: "NP", "ED" or "HD" (see `allocate`).
    profiles: a profile of the model per device type name.
    concurrent: :math:`N_m` to use; defaults to the largest every VW holds,
      :math:`\\min Max_m`. It must not exceed that.
    optimizer_slots: parameter-sized optimizer buffers per stage.
    limit: the largest :math:`Max_m` searched.
    num_virtual_workers: passed to `allocate` (ED only).

  Returns:
    The cluster's plan; `plans[v].boundaries` cut the model for VW `v`.

  References:
    Park et al, HetPipe, 2020, §4 and §8.1.

  Examples:
    >>> from stalepipe.plan.devices import TABLE1
    >>> p = Profile("V", 1, (1.,) * 4, (2.,) * 4, (8,) * 4, (8,) * 4, (8,) * 4)
    >>> cluster = Cluster((Node(TABLE1["V"], 2),))
    >>> plan = plan_cluster(cluster, "NP", {"V": p}, limit=8)
    >>> plan.concurrent, plan.plans[0].boundaries
    (8, (0, 2))
  """
  workers = allocate(cluster, policy, num_virtual_workers)
  signature = lambda vw: tuple(sorted((d.spec.name, d.node) for d in vw))
  max_m = {}
  for vw in workers:
    if signature(vw) not in max_m:
      max_m[signature(vw)] = max_concurrent_minibatches(
          profiles, vw, network=cluster.network,
          optimizer_slots=optimizer_slots, limit=limit)
  max_concurrent = tuple(max_m[signature(vw)] for vw in workers)
  shared = concurrent_minibatches(max_concurrent)
  if concurrent is not None:
    if not 1 <= concurrent <= shared:
      raise ValueError(f"concurrent={concurrent} is invalid for this "
                       f"allocation; valid: 1 to {shared} (min Max_m)")
    shared = concurrent
  plans = tuple(partition(profiles, vw, concurrent=shared,
                          network=cluster.network,
                          optimizer_slots=optimizer_slots) for vw in workers)
  return ClusterPlan(virtual_workers=workers, max_concurrent=max_concurrent,
                     concurrent=shared, plans=plans)
