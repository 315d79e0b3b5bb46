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

import inspect

from stalepipe import registry
from stalepipe.sync.base import SyncPolicy, UpdateEvent, coordinate, group_mixing
from stalepipe.sync.bsp import BSP, bsp
from stalepipe.sync.gossip import ADPSGD, LocalSGD, ad_psgd, local_sgd
from stalepipe.sync.sdpipe import SDPipe, sdpipe
from stalepipe.sync.simulated import Replayed, SimulatedTrace, simulated
from stalepipe.sync.staleness import ObservedStaleness, observed_staleness
from stalepipe.sync.wsp import WSP, WSPState, wsp

PARTS = registry.Registry(
    "sync policy", {"bsp": bsp, "wsp": wsp, "sdpipe": sdpipe,
                    "ad_psgd": ad_psgd, "local_sgd": local_sgd,
                    "simulated": simulated},
    filled=("num_replicas", "schedule", "num_steps"))


def names() -> tuple[str, ...]:
  """The names `make` accepts."""
  return PARTS.names()


def make(name: str, *, num_replicas: int, schedule=None,
         num_steps: int | None = None, **kwargs) -> SyncPolicy:
  """The sync policy registered under `name`, over `num_replicas` replicas.

  `schedule` and `num_steps` (the run's) go to the factories that take them
  (`simulated`); the others never see them.
  """
  takes = inspect.signature(PARTS.factory(name)).parameters
  run = {"schedule": schedule, "num_steps": num_steps}
  kwargs.update({k: v for k, v in run.items()
                 if k in takes and v is not None})
  return PARTS.make(name, num_replicas, **kwargs)
