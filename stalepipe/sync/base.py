"""What a sync policy tells the executors, and how processes agree on it.

A sync policy is a staged collective schedule over the 'data' axis. At each
update event (a stage applying a minibatch's update) it may

- all-reduce the gradient before the update (`average_gradients`, BSP);
- average the new weights within groups, `x <- W x` with a mixing matrix `W`
  over the replicas (SDPipe groups, AD-PSGD pairs, local SGD), `mixing`;
- at the end of a wave, push the wave's aggregated update (one collective)
  and consume the global update of an earlier wave (`wave`,
  `clock_distance`, `wave_delay`; HetPipe's WSP).

The executor runs replicas in lock step; heterogeneity enters as a trace (the
simulator's ready times), which decides groups and how late each replica sees
a global update. Every process must use the same plan, so plans are made on
process 0 and broadcast with JAX's collectives (`coordinate`).
"""

import numpy as np
from jax.experimental import multihost_utils
import jax


class SyncPolicy:
  """Base class: no traffic across replicas unless a subclass says so.

  Attributes:
    num_replicas: D, the size of the 'data' axis.
    average_gradients: all-reduce (mean) every gradient before its update.
    wave: WSP's minibatches per wave (N_m); 0 when the policy has no waves.
    clock_distance: WSP's D.
  """

  name = "none"
  average_gradients = False
  wave = 0
  clock_distance = 0

  def __init__(self, num_replicas: int):
    if not isinstance(num_replicas, int) or num_replicas < 1:
      raise ValueError(f"num_replicas={num_replicas!r} is invalid; it must be "
                       "an integer >= 1")
    self.num_replicas = num_replicas

  def mixing(self, stage: int, minibatch: int) -> np.ndarray | None:
    """`W [D, D]` applied to the new weights after the update, or None."""
    del stage, minibatch
    return None

  def wave_delay(self, wave: int) -> np.ndarray:
    """`[D]` in 0..clock_distance: at the end of wave `wave` each replica has
    the global updates of waves up to `wave - delay`."""
    del wave
    return np.full(self.num_replicas, self.clock_distance, np.int32)

  def plan(self, first_minibatch: int, count: int, num_stages: int
           ) -> dict[str, np.ndarray]:
    """The plan for updates of minibatches `first..first+count-1`.

    Returns:
      `mix [count, S, D, D]` float32 (identity where no averaging),
      `mix_on [count, S]` int32, `delay [count, D]` int32 (for the wave
      ending at that minibatch; minibatches before 0 get zeros).
    """
    D = self.num_replicas
    mix = np.broadcast_to(np.eye(D, dtype=np.float32),
                          (count, num_stages, D, D)).copy()
    mix_on = np.zeros((count, num_stages), np.int32)
    delay = np.zeros((count, D), np.int32)
    for i in range(count):
      p = first_minibatch + i
      if p < 0:
        continue
      for s in range(num_stages):
        w = self.mixing(s, p)
        if w is not None:
          mix[i, s], mix_on[i, s] = w, 1
      if self.wave and (p + 1) % self.wave == 0:
        delay[i] = self.wave_delay(p // self.wave)
    return coordinate({"mix": mix, "mix_on": mix_on, "delay": delay})


def group_mixing(groups, num_replicas: int) -> np.ndarray:
  r"""SDPipe eq. 2: the mixing matrix of disjoint averaging groups.

  .. math:: W(u, v) = 1/|S| \text{ if } u, v \in S;\; W(u, u) = 1
     \text{ if } u \text{ is in no group}; 0 \text{ otherwise.}

  Examples:
    >>> group_mixing([[0, 2]], 3)
    array([[0.5, 0. , 0.5],
           [0. , 1. , 0. ],
           [0.5, 0. , 0.5]], dtype=float32)
  """
  w = np.eye(num_replicas, dtype=np.float32)
  for g in groups:
    g = np.asarray(g, int)
    w[np.ix_(g, g)] = 1.0 / len(g)
  return w


def coordinate(plan: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Process 0's plan, on every process (the central scheduler's decision)."""
  if jax.process_count() == 1:
    return plan
  return {k: np.asarray(v) for k, v in
          multihost_utils.broadcast_one_to_all(plan).items()}
