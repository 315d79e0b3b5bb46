"""What a sync policy tells the executors, and how processes agree on it.

A sync policy is a staged collective schedule over the 'data' axis. At each
update event (a stage applying a minibatch's update) it may

- all-reduce the gradient before the update (`average_gradients`, BSP);
- average the new weights within groups, `x <- W x` with a mixing matrix `W`
  over the replicas (SDPipe groups, AD-PSGD pairs, local SGD), `mixing`;
- at the end of a wave, push the wave's aggregated update (one collective)
  and consume the global update of an earlier wave (`wave`,
  `clock_distance`, `wave_delay`; HetPipe's WSP).

A policy owns that arithmetic once, as two functions over one replica's
values with collectives over a named axis: `reduce_gradient` before the
optimizer and `after_update` after it (with the policy's own state,
`init_state`). The shard_map executor calls them with the mesh's 'data' axis;
the sequential oracle calls the same functions under `jax.vmap` over its
explicit replicas, with the same axis name.

The executor runs replicas in lock step; heterogeneity enters as a trace (the
simulator's ready times), which decides groups and how late each replica sees
a global update. Every process must use the same plan, so plans are made on
process 0 and broadcast with JAX's collectives (`coordinate`).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


class UpdateEvent(NamedTuple):
  """One stage applying one minibatch's update, as one replica sees it."""

  minibatch: Any  # int32 [] (or int): the minibatch's index in the stream
  stage: Any  # int32 []: the stage
  replica: Any  # int32 []: this replica, 0..D-1
  plan: dict  # this minibatch's row of `SyncPolicy.plan`: mix [S, D, D],
  #   mix_on [S], delay [D]


def floating(x) -> bool:
  """Whether a leaf takes part in weight arithmetic (not integer state)."""
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)


def mix(params, weights, axis_name: str):
  """SDPipe eq. 1 for one replica: :math:`x \\leftarrow \\sum_d W_d x_d`.

  Args:
    params: this replica's weights (any pytree).
    weights: `[D]`, this replica's row of the mixing matrix.
    axis_name: the replicas' axis.
  """
  return jax.tree.map(
      lambda v: jnp.einsum("d,d...->...", weights.astype(v.dtype),
                           jax.lax.all_gather(v, axis_name))
      if floating(v) else v, params)


class SyncPolicy:
  """Base class: no traffic across replicas unless a subclass says so.

  Attributes:
    num_replicas: D, the size of the 'data' axis.
    average_gradients: all-reduce (mean) every gradient before its update.
    wave: WSP's minibatches per wave (N_m); 0 when the policy has no waves.
    clock_distance: WSP's D.
    trace: the simulated run a policy replays (`simulated.SimulatedTrace`,
      set by `stalepipe.sync.simulated`), or None.
  """

  name = "none"
  average_gradients = False
  wave = 0
  clock_distance = 0
  trace = None

  def __init__(self, num_replicas: int):
    if not isinstance(num_replicas, int) or num_replicas < 1:
      raise ValueError(f"num_replicas={num_replicas!r} is invalid; it must be "
                       "an integer >= 1")
    self.num_replicas = num_replicas

  def mixing(self, stage: int, minibatch: int) -> np.ndarray | None:
    """`W [D, D]` applied to the new weights after the update, or None."""
    del stage, minibatch
    return None

  @property
  def mixes(self) -> bool:
    """Whether the policy ever averages weights (overrides `mixing`)."""
    return type(self).mixing is not SyncPolicy.mixing

  @property
  def plan_is_static(self) -> bool:
    """Whether every window's plan is the same (no mixing, no waves)."""
    return not self.mixes and not self.wave

  def init_state(self, params) -> Any:
    """The policy's state for one replica's stage weights `params`."""
    del params
    return ()

  def reduce_gradient(self, grads, axis_name: str):
    """The gradient handed to the optimizer (BSP: the replicas' mean)."""
    if self.average_gradients:
      return jax.tree.map(lambda g: jax.lax.pmean(g, axis_name), grads)
    return grads

  def after_update(self, params, previous, state, event: UpdateEvent,
                   axis_name: str):
    """The weights a replica keeps after its optimizer made `params` from
    `previous`, and the policy's new state. Default: group averaging when
    the plan says so."""
    del previous
    if not self.mixes:
      return params, state
    on = event.plan["mix_on"][event.stage] == 1
    weights = event.plan["mix"][event.stage, event.replica]
    return jax.lax.cond(on, lambda: mix(params, weights, axis_name),
                        lambda: params), state

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
