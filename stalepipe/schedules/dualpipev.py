r"""DualPipeV: DeepSeek's V-shaped DualPipe, with overlapped forward-backward pairs.

DeepSeek's DualPipeV (the "cut-in-half" DualPipe of Sea AI Lab) places 2P
stages on P devices in a V (device r holds stage r, its phase 0, and stage
2P - 1 - r, its phase 1: the "v" placement) and runs, on device r, the eight
steps of `DualPipeV.step` (deepseek-ai/DualPipe `dualpipe/dualpipev.py`;
torch's `ScheduleDualPipeV` transcribes them), for M >= 2P micro-batches:

1. :math:`2(P - r - 1)` forwards of phase 0;
2. :math:`r + 1` pairs (F phase 0, F phase 1);
3. :math:`P - r - 1` triples (BI phase 1, the oldest pending BW, F phase 1);
4. :math:`M - 2P + r + 1` pairs of overlapped units (F phase 0 & B phase 1,
   then F phase 1 & B phase 0); the last device runs its first F0 and B1
   apart;
5. :math:`P - r - 1` pairs (B phase 1, then F phase 1 & B phase 0);
6. :math:`r + 1` pairs (B phase 1, B phase 0), the second half of them
   split (BI now, BW queued);
7. :math:`P - r - 1` pairs (the oldest BW, BI phase 0);
8. :math:`r + 1` BW tasks.

A full backward B (kind "B") is one task of :math:`T_B = T_I + T_W = 2`
ticks; a split one is BI now and BW later (DeepSeek's `WeightGradStore`, in
FIFO order). An overlapped unit (torch's `OVERLAP_F_B`) is a forward and a
full backward of different stages and micro-batches on one device that start
in one tick and run together, hiding each one's communication under the
other's compute: `Schedule.overlapped` lists them as (F, B) pairs, and the
device is busy for :math:`T_{F\&B} = \max(T_F, T_B) = 2` ticks. The
DualPipe README's bubble, :math:`(PP/2 - 1)(T_{F\&B} + T_B - 3T_W)` with
PP = 2P stages, is then :math:`P - 1` ticks: the idle ticks of the last
two devices (device r idles :math:`\min(r + 1, P - 1)`); a minibatch takes
:math:`4M + 3P` ticks; every device holds at most :math:`PP + 1 = 2P + 1`
micro-batches of a chunk.

References:
  DeepSeek-AI, DeepSeek-V3 Technical Report
  <https://arxiv.org/abs/2412.19437>, 2024 (§3.2.1, DualPipe);
  https://github.com/deepseek-ai/DualPipe (`dualpipe/dualpipev.py`, README
  table); torch.distributed.pipelining `ScheduleDualPipeV`.
"""

from stalepipe.schedules import ordered
from stalepipe.schedules.core import Schedule
from stalepipe.schedules.zb_v import v_devices


def dualpipev(num_stages: int, num_microbatches: int,
              num_minibatches: int = 1) -> Schedule:
  """Builds DualPipeV on P = S / 2 devices.

  Args:
    num_stages: S = 2P, even.
    num_microbatches: M, at least 2P.
    num_minibatches: B, minibatches in the table (a flush between them).

  Returns:
    The device-level schedule, its overlapped units in `overlapped`.

  Examples:
    >>> s = dualpipev(num_stages=8, num_microbatches=8)
    >>> s.num_ticks, s.device_max_in_flight
    (44, (9, 9, 9, 9))
  """
  S, M = num_stages, num_microbatches
  P = v_devices("dualpipev", S)
  if M < 2 * P:
    raise ValueError(f"num_microbatches={M} is invalid for dualpipev with "
                     f"{S} stages; it must be >= num_stages = {2 * P}")

  def order(r):
    phase = (r, S - 1 - r)
    forwards, backwards = [0, 0], [0, 0]
    pending = []  # split backwards whose BW is still to run, oldest first
    out = []

    def f(ph):
      forwards[ph] += 1
      return (phase[ph], "F", forwards[ph] - 1)

    def b(ph, split=False):
      backwards[ph] += 1
      if split:
        pending.append((phase[ph], "BW", backwards[ph] - 1))
      return (phase[ph], "BI" if split else "B", backwards[ph] - 1)

    def w():
      if pending:
        out.append((pending.pop(0),))

    for _ in range(2 * (P - r - 1)):  # 1: nF0
      out.append((f(0),))
    for _ in range(r + 1):  # 2: nF0F1
      out.extend([(f(0),), (f(1),)])
    for _ in range(P - r - 1):  # 3: nB1W1F1, zero bubble
      out.append((b(1, split=True),))
      w()
      out.append((f(1),))
    for i in range(M - 2 * P + r + 1):  # 4: nF0B1F1B0, overlapped
      if i == 0 and r == P - 1:
        out.extend([(f(0),), (b(1),)])
      else:
        out.append((f(0), b(1)))
      out.append((f(1), b(0)))
    for _ in range(P - r - 1):  # 5: nB1F1B0
      out.append((b(1),))
      out.append((f(1), b(0)))
    split = False
    for i in range(r + 1):  # 6: nB1B0, the second half split
      split = split or (i == (r + 1) // 2 and r % 2 == 1)
      out.append((b(1, split),))
      split = split or (i == (r + 1) // 2 and r % 2 == 0)
      out.append((b(0, split),))
    for _ in range(P - r - 1):  # 7: nWB0, zero bubble
      w()
      out.append((b(0, split=True),))
    for _ in range(r + 1):  # 8: nW
      w()
    return out

  return ordered.build("dualpipev", S, M, num_minibatches, placement="v",
                       num_devices=P, order=order, durations={"B": 2})
