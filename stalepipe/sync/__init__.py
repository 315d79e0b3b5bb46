"""Synchronisation across pipelines as staged collective schedules.

Each policy tells the executors what crosses the 'data' axis at each update
event (see `base.py`): BSP's gradient all-reduce, HetPipe's WSP waves,
SDPipe's scheduled group averaging, AD-PSGD's random pairs, local SGD.

Examples:
  >>> import stalepipe as sp
  >>> policy = sp.sync.make("wsp", num_replicas=2, clock_distance=0,
  ...                       concurrent_minibatches=4)
  >>> policy.wave, policy.clock_distance
  (4, 0)
"""

from stalepipe import registry
from stalepipe.sync.base import SyncPolicy, UpdateEvent, coordinate, group_mixing
from stalepipe.sync.bsp import BSP, bsp
from stalepipe.sync.gossip import ADPSGD, LocalSGD, ad_psgd, local_sgd
from stalepipe.sync.sdpipe import SDPipe, sdpipe
from stalepipe.sync.staleness import ObservedStaleness, observed_staleness
from stalepipe.sync.wsp import WSP, WSPState, wsp

PARTS = registry.Registry(
    "sync policy", {"bsp": bsp, "wsp": wsp, "sdpipe": sdpipe,
                    "ad_psgd": ad_psgd, "local_sgd": local_sgd},
    filled=("num_replicas",))


def names() -> tuple[str, ...]:
  """The names `make` accepts."""
  return PARTS.names()


def make(name: str, *, num_replicas: int, **kwargs) -> SyncPolicy:
  """The sync policy registered under `name`, over `num_replicas` replicas."""
  return PARTS.make(name, num_replicas, **kwargs)
