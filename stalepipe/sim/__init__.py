"""A discrete-event simulator of a heterogeneous cluster (DESIGN.md, plane 3).

`simulate(schedule, cluster, costs, policy)` times a schedule on every
pipeline of a `Cluster` (devices with speed and memory, intra- and inter-node
links), with a sync policy across pipelines and injected slowdowns, and
returns a `SimResult`: throughput, per-device busy/idle/wait time, observed
staleness per minibatch and a timeline for `stalepipe.schedules.render`.

The policy may be the very `stalepipe.sync` object the executors run
(`sp.sync.wsp(N, clock_distance=0, concurrent_minibatches=4)`): one name and
one set of arguments for numerics and timing. A planner's result becomes the
cluster and costs in one call, `from_plan(plan)`, in the planner's own
vocabulary of devices, links and networks (`stalepipe.plan.devices`).

Examples:
  >>> import stalepipe as sp
  >>> s = sp.schedules.make("gpipe", num_stages=4, num_microbatches=4,
  ...                       num_minibatches=3)
  >>> cluster = sp.sim.Cluster.grid(2, 4, devices_per_node=4)
  >>> costs = sp.sim.StageCosts.uniform(4, forward=0.01, backward=0.02,
  ...                                   param_bytes=1e8)
  >>> r = sp.sim.simulate(s, cluster, costs, sp.sim.bsp())
  >>> round(r.makespan, 4), int(r.staleness.max())
  (0.6732, 0)
  >>> same = sp.sim.simulate(s, cluster, costs, sp.sync.bsp(2))
  >>> same.makespan == r.makespan
  True
"""

from stalepipe.sim import clusters
from stalepipe.sim.cluster import Cluster
from stalepipe.sim.cluster import Device
from stalepipe.sim.cluster import Link
from stalepipe.sim.cluster import StageCosts
from stalepipe.sim.cluster import ring_allreduce_seconds
from stalepipe.sim.engine import simulate
from stalepipe.sim.planned import Planned
from stalepipe.sim.planned import from_plan
from stalepipe.sim.result import SimResult
from stalepipe.sim.policy import ad_psgd
from stalepipe.sim.policy import bsp
from stalepipe.sim.policy import isolated
from stalepipe.sim.policy import local_sgd
from stalepipe.sim.policy import parameter_server
from stalepipe.sim.policy import time_side
from stalepipe.sim.sdpipe_sync import sdpipe
from stalepipe.sim.stragglers import Stragglers
from stalepipe.sim.stragglers import Trace
from stalepipe.sim.stragglers import hete
from stalepipe.sim.stragglers import load_trace
from stalepipe.schedules.tiling import tile
from stalepipe.sim.wsp_sync import wsp

__all__ = (
    "Cluster", "Device", "Link", "Planned", "SimResult", "StageCosts",
    "Stragglers", "Trace", "ad_psgd", "bsp", "clusters", "from_plan", "hete",
    "isolated", "load_trace", "local_sgd", "parameter_server",
    "ring_allreduce_seconds", "sdpipe", "simulate", "tile", "time_side", "wsp",
)
