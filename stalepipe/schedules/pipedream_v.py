r"""Asynchronous PipeDream on a V placement, two chunks a device.

PipeDream's rules (`pipedream.py`: weight stashing, each stage's update
after its own backward, no flush) per chunk on the V placement of ZB-V and
DualPipeV (`zb_v.py`: device r holds stages r and 2P - 1 - r), one task a
device a tick, one minibatch entering every 4 ticks (`stashed.py`). No
framework runs it.

Version map: chunk s of minibatch p reads :math:`\max(0, p - d_s)` with

.. math:: d_s = \begin{cases} P - 1 - \lfloor s/2 \rfloor & P \text{ odd} \\
                              P - \lceil s/2 \rceil & P \text{ even}
                \end{cases}

With P odd a minibatch's four tasks on a device never share a residue
mod 4, so stage s runs its forward s ticks and its backward 2S - 1 - s
ticks after entry, and the minibatches entering every 4 ticks in between,
:math:`\lfloor (2S - 1 - 2s) / 4 \rfloor` of them, are missed: stage-level
PipeDream's S - 1 - s halved. With P even a device's forward of one chunk
and backward of the other would share one; the minibatch waits two ticks
at the turn (`stashed.py`), every backward two ticks later: one more
missed minibatch on the even stages.

Stash: the round trips of a device's two chunks add up to 2S ticks, half a
minibatch's work each, so every device keeps about P + 2 versions (P + 2
with P even, P + 1 with P odd): the V balances the stash as it balances a
folded PipeDream's, with P in flight instead of S.

References:
  Narayanan et al, PipeDream: Generalized Pipeline Parallelism for DNN
  Training <https://arxiv.org/abs/1806.03377>, 2019; Qi et al, Pipeline
  Parallelism with Controllable Memory <https://arxiv.org/abs/2405.15362>,
  2024 (the V placement).
"""

from stalepipe.schedules import stashed
from stalepipe.schedules.core import Schedule
from stalepipe.schedules.zb_v import v_devices


def pipedream_v(num_stages: int, num_microbatches: int,
                num_minibatches: int = 1, *,
                max_in_flight: int | None = None) -> Schedule:
  """Builds asynchronous PipeDream on the V placement of P = S / 2 devices.

  Args:
    num_stages: S = 2P, even.
    num_microbatches: M = 1.
    num_minibatches: B, minibatches in the table (no flush between them).
    max_in_flight: K, the most minibatches in flight; None: as many as keep
      every device busy (P + 1 for P >= 2).

  Returns:
    The device-level schedule.

  Examples:
    >>> s = pipedream_v(8, 1, 16)
    >>> [15 - s.version(15, stage, "F") for stage in range(8)]
    [4, 3, 3, 2, 2, 1, 1, 0]
    >>> s.device_stash_depth
    (6, 6, 6, 6)
  """
  P = v_devices("pipedream-v", num_stages)
  return stashed.build("pipedream-v", num_stages, num_microbatches,
                       num_minibatches, placement="v", num_devices=P,
                       max_in_flight=max_in_flight)
