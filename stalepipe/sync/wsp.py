r"""HetPipe's Wave Synchronous Parallel, numeric side (seed 001 §5, seed 000).

Each virtual worker (pipeline replica) applies its own updates locally at
once. A *wave* is :math:`N_m` consecutive minibatches. When a stage applies
the update of a wave's last minibatch it pushes the wave's aggregated update
:math:`\tilde u_c` (one collective per wave). The parameter server adds every
worker's push, :math:`w_{global} \leftarrow w_{global} + \tilde u_c` (§5; eq. 1
sums :math:`u` over all workers with weight 1), so the global update of wave
:math:`c` is the *sum* over workers (`server="sum"`, HetPipe, the default).
At the end of its wave :math:`c` a worker pulls the global updates of waves up
to :math:`c - \delta`, :math:`\delta \le D` (the clock distance), each
replacing its own contribution:

.. math::

  w_{local} \leftarrow w_{local} + \sum_{d} \tilde u^{(d)}_c
  - \tilde u_c^{(self)}.

So after its wave-:math:`c` pull a worker holds the global updates of waves
:math:`0..c-\delta` and its own updates since, which is HetPipe's
:math:`w_{local}`. In lock step every worker pushes every wave at the same
time; without a trace, :math:`\delta = D` (the bound), which makes a
minibatch's observed staleness reach
:math:`s_{global} = (D+1)(s_{local}+1) + s_{local} - 1`. A trace (from the
simulator: how many waves behind each worker saw each global update) replays
smaller delays. `server="mean"` averages the pushes instead,
:math:`\frac{1}{n}\sum_d \tilde u^{(d)}_c`: not HetPipe, but the variant in
which :math:`D = 0, N_m = 1` is exactly gradient-mean BSP for SGD.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stalepipe.sync import base

SERVERS = ("sum", "mean")


class WSPState(NamedTuple):
  """One replica's WSP state for one stage's weights."""

  own: Any  # like the weights: this wave's own updates so far
  pending: Any  # like the weights, with a leading [D+1]: the global-minus-own
  #   update of a pushed wave not yet pulled, one slot per wave in flight
  pending_wave: jax.Array  # int32 [D+1]: the wave in each slot; -1: empty


class WSP(base.SyncPolicy):
  """WSP with clock distance D and N_m minibatches per wave.

  Args:
    num_replicas: n, the virtual workers.
    clock_distance: D >= 0.
    concurrent_minibatches: N_m >= 1 (HetPipe's schedule option).
    server: how the parameter server combines the workers' pushes: "sum"
      (HetPipe, seed 001 §5) or "mean" (D=0, N_m=1 is gradient-mean BSP).
    delays: optional `[waves, n]` ints in `0..D`: at the end of its wave c,
      worker d has seen the global updates of waves up to
      `c - delays[c, d]` (a replayed trace); waves past its end use D.

  References:
    Park et al, HetPipe: Enabling Large DNN Training on (Whimpy) Heterogeneous
    GPU Clusters through Integration of Pipelined Model Parallelism and Data
    Parallelism <https://arxiv.org/abs/2005.14038>, 2020, §5
  """

  name = "wsp"

  def __init__(self, num_replicas: int, clock_distance: int,
               concurrent_minibatches: int, delays=None, server: str = "sum"):
    super().__init__(num_replicas)
    if server not in SERVERS:
      raise ValueError(f"server={server!r} is invalid; valid: "
                       f"{', '.join(SERVERS)}")
    self.server = server
    for arg, value, low in (("clock_distance", clock_distance, 0),
                            ("concurrent_minibatches", concurrent_minibatches,
                             1)):
      if not isinstance(value, int) or value < low:
        raise ValueError(f"{arg}={value!r} is invalid; it must be an integer "
                         f">= {low}")
    self.clock_distance = clock_distance
    self.wave = concurrent_minibatches
    self.delays = None if delays is None else np.asarray(delays, np.int32)
    if self.delays is not None and (
        self.delays.ndim != 2 or self.delays.shape[1] != num_replicas
        or not self.delays.size or self.delays.min() < 0
        or self.delays.max() > clock_distance):
      raise ValueError(f"delays of shape {self.delays.shape} are invalid; "
                       f"valid: [waves >= 1, {num_replicas}] with values in "
                       f"0..{clock_distance}")

  def wave_delay(self, wave: int) -> np.ndarray:
    """The trace's delays for `wave`, or D past its end (see `SyncPolicy`)."""
    if self.delays is not None and wave < len(self.delays):
      return self.delays[wave]
    return super().wave_delay(wave)

  def init_state(self, params) -> WSPState:
    """No own updates and no pending global updates yet."""
    slots = self.clock_distance + 1
    return WSPState(
        own=jax.tree.map(jnp.zeros_like, params),
        pending=jax.tree.map(
            lambda x: jnp.zeros((slots,) + jnp.shape(x), jnp.asarray(x).dtype),
            params),
        pending_wave=jnp.full((slots,), -1, jnp.int32))

  def after_update(self, params, previous, state: WSPState,
                   event: base.UpdateEvent, axis_name: str):
    """Adds the update to the wave's own sum; at the wave's end, pushes it
    (one collective) and adds the global updates now due (`delay` waves
    behind, from the plan)."""
    own = jax.tree.map(lambda o, x, y: o + (x - y) if base.floating(x) else o,
                       state.own, params, previous)
    combine = jax.lax.psum if self.server == "sum" else jax.lax.pmean

    def end_of_wave():
      c = event.minibatch // self.wave
      slot = c % (self.clock_distance + 1)
      pending = jax.tree.map(
          lambda q, o: q.at[slot].set(combine(o, axis_name) - o)
          if base.floating(o) else q, state.pending, own)
      tags = state.pending_wave.at[slot].set(c)
      due = (tags >= 0) & (tags <= c - event.plan["delay"][event.replica])
      new = jax.tree.map(
          lambda x, q: x + jnp.einsum("q,q...->...", due.astype(x.dtype), q)
          if base.floating(x) else x, params, pending)
      return new, WSPState(jax.tree.map(jnp.zeros_like, own), pending,
                           jnp.where(due, -1, tags))

    return jax.lax.cond((event.minibatch + 1) % self.wave == 0, end_of_wave,
                        lambda: (params, state._replace(own=own)))


def wsp(num_replicas: int, clock_distance: int, concurrent_minibatches: int,
        delays=None, server: str = "sum") -> WSP:
  """WSP (see `WSP`).

  Examples:
    >>> wsp(2, clock_distance=1, concurrent_minibatches=4).wave
    4
  """
  return WSP(num_replicas, clock_distance, concurrent_minibatches, delays,
             server)
