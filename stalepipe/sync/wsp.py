r"""HetPipe's Wave Synchronous Parallel, numeric side (seed 001 §5, seed 000).

Each virtual worker (pipeline replica) applies its own updates locally at
once. A *wave* is :math:`N_m` consecutive minibatches. When a stage applies
the update of a wave's last minibatch it pushes the wave's aggregated update
:math:`\tilde u_c` (one collective per wave); the parameter server's global
update of wave :math:`c` is the mean over workers. At the end of its wave
:math:`c` a worker pulls the global updates of waves up to :math:`c - \delta`,
:math:`\delta \le D` (the clock distance), each replacing its own
contribution:

.. math::

  w_{local} \leftarrow w_{local} + \frac{1}{n}\sum_{d} \tilde u^{(d)}_c
  - \tilde u_c^{(self)}.

So after its wave-:math:`c` pull a worker holds the global updates of waves
:math:`0..c-\delta` and its own updates since, which is HetPipe's
:math:`w_{local}`. In lock step every worker pushes every wave at the same
time; without a trace, :math:`\delta = D` (the bound), which makes a
minibatch's observed staleness reach
:math:`s_{global} = (D+1)(s_{local}+1) + s_{local} - 1`. A trace (from the
simulator: how many waves behind each worker saw each global update) replays
smaller delays. The mean (not the sum) of the pushed updates makes
:math:`D = 0, N_m = 1` exactly BSP for SGD.
"""

import numpy as np

from stalepipe.sync import base


class WSP(base.SyncPolicy):
  """WSP with clock distance D and N_m minibatches per wave.

  Args:
    num_replicas: n, the virtual workers.
    clock_distance: D >= 0.
    concurrent_minibatches: N_m >= 1 (HetPipe's schedule option).
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
               concurrent_minibatches: int, delays=None):
    super().__init__(num_replicas)
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


def wsp(num_replicas: int, clock_distance: int, concurrent_minibatches: int,
        delays=None) -> WSP:
  """WSP (see `WSP`).

  Examples:
    >>> wsp(2, clock_distance=1, concurrent_minibatches=4).wave
    4
  """
  return WSP(num_replicas, clock_distance, concurrent_minibatches, delays)
