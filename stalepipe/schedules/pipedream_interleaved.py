r"""Asynchronous PipeDream on interleaved chunks (loop placement).

PipeDream's rules (`pipedream.py`: weight stashing, each stage's update
after its own backward, no flush) per chunk on the loop placement of
interleaved 1F1B (`interleaved.py`: stage s on device s mod P, v = S / P
chunks a device), one task a device a tick, one minibatch entering every
:math:`2v` ticks (`stashed.py`). No framework runs it.

Version map: chunk s of minibatch p reads :math:`\max(0, p - d_s)`. A
minibatch waits :math:`\delta` ticks each time it returns from device P - 1
to device 0, both ways, :math:`\delta` the least with :math:`P + \delta`
even and :math:`\gcd((P + \delta) / 2, v) = 1` (v > 1), so that a device's
v forwards take the residues mod 2v of one parity and its v backwards the
others; with :math:`a_s = s + \delta \lfloor s/P \rfloor` and
:math:`b_s = 2S - 1 + 2(v - 1)\delta - s - \delta \lfloor s/P \rfloor`
(`stashed.py`),

.. math:: d_s = \left\lfloor \frac{2S - 1 - 2s
          + 2\delta\,(v - 1 - \lfloor s/P \rfloor)}{2v} \right\rfloor,

which is :math:`P - 1 - \lfloor s/v \rfloor` where :math:`\delta = 0` (P
even, :math:`\gcd(P/2, v) = 1`: v = 3 on 4 or 8 devices): stage-level
PipeDream's :math:`S - 1 - s` divided by v, a minibatch entering every 2v
ticks, not every 2. v = 2 on 4 or 8 devices waits :math:`\delta = 2`:
:math:`d = (4, 4, 3, 3, 1, 1, 0, 0)` on 4 devices.

References:
  Narayanan et al, PipeDream: Generalized Pipeline Parallelism for DNN
  Training <https://arxiv.org/abs/1806.03377>, 2019; Narayanan et al,
  Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM <https://arxiv.org/abs/2104.04473>, SC 2021 (§2.2).
"""

from stalepipe.schedules import interleaved
from stalepipe.schedules import stashed
from stalepipe.schedules.core import Schedule


def pipedream_interleaved(num_stages: int, num_microbatches: int,
                          num_minibatches: int = 1, *, num_devices: int,
                          max_in_flight: int | None = None) -> Schedule:
  """Builds asynchronous PipeDream on the loop placement of P devices.

  Args:
    num_stages: S = v P.
    num_microbatches: M = 1.
    num_minibatches: B, minibatches in the table (no flush between them).
    num_devices: P, devices on the loop placement.
    max_in_flight: K, the most minibatches in flight; None: as many as keep
      every device busy.

  Returns:
    The device-level schedule.

  Examples:
    >>> s = pipedream_interleaved(12, 1, 16, num_devices=4)
    >>> [15 - s.version(15, stage, "F") for stage in range(12)]
    [3, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]
  """
  interleaved.device_chunks("pipedream-interleaved", num_stages, num_devices)
  return stashed.build("pipedream-interleaved", num_stages, num_microbatches,
                       num_minibatches, placement="loop",
                       num_devices=num_devices, max_in_flight=max_in_flight)
