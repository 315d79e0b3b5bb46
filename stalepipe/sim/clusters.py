"""Named clusters with their stage costs, for a config to time its run on.

`make(name, num_pipelines=N, num_stages=S, num_microbatches=M)` returns the
`(Cluster, StageCosts)` of the named setting shaped to a run's N x S workers
and M micro-batches, so a config names where its run is simulated
(`sp.sync.make("simulated", ..., cluster="resnet50_10gbe")`) as it names
every other part.

Examples:
  >>> cluster, costs = make("resnet50_10gbe", num_pipelines=4, num_stages=2,
  ...                       num_microbatches=2)
  >>> cluster.num_pipelines, cluster.num_stages, round(costs.forward[0], 4)
  (4, 2, 0.035)
"""

from stalepipe import registry
from stalepipe.sim.cluster import Cluster
from stalepipe.sim.cluster import Link
from stalepipe.sim.cluster import StageCosts

ETHERNET = Link(10e9 / 8, 50e-6)  # 10 Gb Ethernet between nodes
NVLINK = Link(100e9, 5e-6)  # inside a node


def resnet50_10gbe(num_pipelines: int, num_stages: int,
                   num_microbatches: int) -> tuple[Cluster, StageCosts]:
  r"""Seed 002 §5.1's ResNet-50 setting, one pipeline per node.

  A minibatch is 256 images at :math:`6 \times 4.1` GMAC each on 15 TFLOP/s
  GPUs, split evenly over stages and micro-batches, the backward twice the
  forward; 25.6 M float32 parameters split evenly; NVLink-class links inside
  a node, 10 Gb Ethernet between nodes and to a parameter server. Each
  pipeline sits on its own S-GPU node, so a stage's replicas talk over
  Ethernet, as in the paper's 4 x 4 run across two 8-GPU nodes.

  References:
    Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023, §5.1
  """
  per_micro = 6 * 4.1e9 * 256 / 15e12 / num_stages / num_microbatches
  costs = StageCosts.uniform(
      num_stages, per_micro / 3, 2 * per_micro / 3,
      activation_bytes=256 * 512 * 28 * 28 * 4 / num_microbatches,
      param_bytes=25.6e6 * 4 / num_stages,
      samples_per_microbatch=256 // num_microbatches)
  cluster = Cluster.grid(num_pipelines, num_stages,
                         devices_per_node=num_stages, intra=NVLINK,
                         inter=ETHERNET, ps=ETHERNET)
  return cluster, costs


PARTS = registry.Registry(
    "simulated cluster", {"resnet50_10gbe": resnet50_10gbe},
    filled=("num_pipelines", "num_stages", "num_microbatches"))


def names() -> tuple[str, ...]:
  """The names `make` accepts."""
  return PARTS.names()


def make(name: str, *, num_pipelines: int, num_stages: int,
         num_microbatches: int) -> tuple[Cluster, StageCosts]:
  """The cluster and stage costs registered as `name`, shaped to the run."""
  return PARTS.make(name, num_pipelines=num_pipelines, num_stages=num_stages,
                    num_microbatches=num_microbatches)
