"""Heterogeneity-aware planning (seed 001 HetPipe §4, §7, §8.1).

Profiles of a model's blocks, HetPipe's memory-aware partitioner over the
distinct orders of heterogeneous devices, :math:`Max_m` / :math:`N_m`, and the
NP / ED / HD allocation of a cluster into virtual workers.

Examples:
  >>> import stalepipe as sp
  >>> cluster = sp.plan.Cluster(tuple(sp.plan.Node(sp.plan.TABLE1[t], 4)
  ...                                 for t in "VRGQ"))
  >>> ["".join(d.spec.name for d in vw)
  ...  for vw in sp.plan.allocate(cluster, "ED")]
  ['VRGQ', 'VRGQ', 'VRGQ', 'VRGQ']
"""

from stalepipe.plan.allocate import (POLICIES, Cluster, ClusterPlan, Node,
                                     allocate, concurrent_minibatches,
                                     plan_cluster)
from stalepipe.plan.devices import (GIB, HETPIPE_NETWORK, QUADRO_P4000,
                                    RTX_2060, TABLE1, TITAN_RTX, TITAN_V,
                                    Device, DeviceType, Link, Network)
from stalepipe.plan.partition import (InfeasiblePlanError, Plan,
                                      activations_in_flight,
                                      max_concurrent_minibatches, partition,
                                      stage_memory)
from stalepipe.plan.profile import Profile, load, measure, save, scale

__all__ = [
    "GIB", "HETPIPE_NETWORK", "POLICIES", "QUADRO_P4000", "RTX_2060", "TABLE1",
    "TITAN_RTX", "TITAN_V", "Cluster", "ClusterPlan", "Device", "DeviceType",
    "InfeasiblePlanError", "Link", "Network", "Node", "Plan", "Profile",
    "activations_in_flight", "allocate", "concurrent_minibatches", "load",
    "max_concurrent_minibatches", "measure", "partition", "plan_cluster",
    "save", "scale", "stage_memory",
]
