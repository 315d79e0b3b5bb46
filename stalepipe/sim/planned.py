"""A plan as a simulated cluster: `from_plan` (seed 001 §4, §8.1).

The planner (`stalepipe.plan`) cuts a model over each virtual worker's
devices and times every stage on its own device; the simulator runs pipelines
of devices on one per-stage cost table scaled by each device's speed. A plan
becomes a cluster plus costs in one call: each virtual worker is a pipeline,
its stages on the plan's devices in pipeline order, the first worker's stage
times are the cost table and every device's speed is that stage's time over
its own, so each stage of each worker takes exactly its planned time.

References:
  Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §4 (model
  partitioning, N_m) and §8.1 (cluster, parameter-server placement)
"""

from typing import NamedTuple

from stalepipe.plan import devices as devices_lib
from stalepipe.plan.allocate import ClusterPlan
from stalepipe.plan.partition import Plan
from stalepipe.sim import cluster as cluster_lib

PS_PLACEMENTS = ("inter", "intra")
_RTOL = 1e-9  # backward / forward agreement across workers


class Planned(NamedTuple):
  """What `simulate` needs besides a schedule and a policy."""

  cluster: cluster_lib.Cluster
  costs: cluster_lib.StageCosts


def from_plan(plan: ClusterPlan | Plan, *,
              num_pipelines: int = 1,
              network: devices_lib.Network = devices_lib.HETPIPE_NETWORK,
              ps: str = "inter", ps_shared: bool = True,
              samples_per_microbatch: int = 1) -> Planned:
  """The simulated cluster and stage costs of a plan.

  Args:
    plan: a `ClusterPlan` (`plan_cluster`: one pipeline per virtual worker)
      or one virtual worker's `Plan` (`partition`: `num_pipelines` copies).
    num_pipelines: copies of a single `Plan`; must be 1 for a `ClusterPlan`.
    network: the links within and between nodes.
    ps: where each stage's parameter-server shard sits: "inter" (behind the
      inter-node link) or "intra" (on the stage's own node, seed 001 §8.1's
      ED-local).
    ps_shared: whether the replicas' pushes and pulls queue at a shard.
    samples_per_microbatch: samples in one of the plan's minibatches as the
      schedule splits it (the plan times whole minibatches).

  Returns:
    `(cluster, costs)`: `simulate(schedule, *from_plan(plan), policy)`.
    Activation and parameter bytes are per stage; where the workers'
    partitions differ they are the largest over the workers.

  Raises:
    ValueError: a worker's stages do not line up with the first worker's
      (another stage count, or a backward/forward ratio the shared cost
      table cannot express).

  Examples:
    >>> import stalepipe as sp
    >>> p = sp.plan.Profile("V", 32, (1.,) * 4, (2.,) * 4, (8,) * 4,
    ...                     (8,) * 4, (8,) * 4)
    >>> cluster = sp.plan.Cluster((sp.plan.Node(sp.plan.TITAN_V, 4),))
    >>> planned = sp.plan.plan_cluster(cluster, "ED", {"V": p},
    ...                                num_virtual_workers=2, limit=4)
    >>> c, costs = from_plan(planned)
    >>> c.num_pipelines, c.num_stages, costs.forward
    (2, 2, (2.0, 2.0))
  """
  if ps not in PS_PLACEMENTS:
    raise ValueError(f"ps={ps!r} is invalid; valid: {', '.join(PS_PLACEMENTS)}")
  if isinstance(plan, ClusterPlan):
    if num_pipelines != 1:
      raise ValueError(f"num_pipelines={num_pipelines!r} is invalid for a "
                       "ClusterPlan (one pipeline per virtual worker); "
                       "valid: 1")
    plans = plan.plans
  else:
    if not isinstance(num_pipelines, int) or num_pipelines < 1:
      raise ValueError(f"num_pipelines={num_pipelines!r} is invalid; it must "
                       "be an integer >= 1")
    plans = (plan,) * num_pipelines
  first = plans[0]
  S = len(first.devices)
  rows = []
  for k, p in enumerate(plans):
    if len(p.devices) != S:
      raise ValueError(f"virtual worker {k} has {len(p.devices)} stages; "
                       f"valid: {S}, as worker 0")
    speed = [f0 / f for f0, f in zip(first.forward_s, p.forward_s)]
    for s in range(S):
      want = first.backward_s[s] / speed[s]
      if abs(want - p.backward_s[s]) > _RTOL * p.backward_s[s]:
        raise ValueError(
            f"stage {s} of virtual worker {k} has backward/forward "
            f"{p.backward_s[s] / p.forward_s[s]:.6g} against worker 0's "
            f"{first.backward_s[s] / first.forward_s[s]:.6g}; valid: equal "
            "ratios (one cost table, scaled by device speed)")
    rows.append(tuple(cluster_lib.Device.of(d, v)
                      for d, v in zip(p.devices, speed)))
  costs = cluster_lib.StageCosts(
      forward=tuple(first.forward_s), backward=tuple(first.backward_s),
      activation_bytes=tuple(max(p.activation_bytes[s] for p in plans)
                             for s in range(S)),
      param_bytes=tuple(max(p.param_bytes[s] for p in plans)
                        for s in range(S)),
      samples_per_microbatch=samples_per_microbatch)
  cluster = cluster_lib.Cluster(
      tuple(rows), intra=network.intra, inter=network.inter,
      ps=network.intra if ps == "intra" else network.inter,
      ps_shared=ps_shared)
  return Planned(cluster, costs)
