r"""ZB-V: zero bubble's V-shaped schedule, two chunks per device.

Qi et al (2024, §6) place 2P stages on P devices in a V (device r holds
stages r and 2P - 1 - r, the "v" placement), split every backward into its
input-gradient task BI and weight-gradient task BW, and order each device's
work so that, with :math:`T_F = T_B = T_W`, the steady state has no bubble
and every device holds at most :math:`2P` micro-batches' activations,
1F1B's peak, in chunks of half the size (Figure 8). Device r runs the order
of torch's `ScheduleZBVZeroBubble._calculate_single_rank_operations`
(`torch/distributed/pipelining/schedules.py`), with :math:`n =
\max(2P - 1, M)` and the actions of micro-batches :math:`\ge M` dropped:

1. warm-up: :math:`2(P - r) - 1` forwards on chunk 0, then :math:`r` pairs
   (F chunk 1, F chunk 0), then :math:`P - r` triples (F, BI, BW) on chunk 1;
2. steady: (F chunk 0 while any is left, BI and BW chunk 0, F, BI and BW
   chunk 1) until chunk 1 has run as many forwards as chunk 0 and chunk 0
   has run :math:`n`;
3. cool-down: :math:`r` pairs (BI chunk 0, BI chunk 1), :math:`P - r` pairs
   (BI, BW) on chunk 0, then the BW tasks left, chunk 1's first.

With unit F, BI and BW and :math:`M \ge 2P` a minibatch takes

.. math:: 3vM + P - 1 = 6M + P - 1

ticks (v = 2 chunks): every device works :math:`3 \cdot 2M` ticks and the
fill and drain add :math:`P - 1`, which the paper does not count as bubble
(its bubble rate with :math:`T_F = T_B = T_W` is 0, like ZB-H2's
:math:`3M + S - 1`), and every device holds at most :math:`2P` micro-batches
of a chunk, the activations of :math:`P` whole stages: 1F1B's peak.

Synchronous as ZB-H2: every task of minibatch p reads version p, and each
stage applies its update after its own last BW, so a stage may start
minibatch p + 1 while another still runs p's BW; `Schedule.together`
refuses it (a whole-model update rule would stall the V).

References:
  Qi et al, Pipeline Parallelism with Controllable Memory / Zero Bubble
  Pipeline Parallelism <https://arxiv.org/abs/2401.10241>, ICLR 2024 (§6,
  Figure 8); torch.distributed.pipelining `ScheduleZBVZeroBubble`.
"""

from stalepipe.schedules import ordered
from stalepipe.schedules.core import Schedule


def v_devices(name: str, num_stages: int) -> int:
  """P = S / 2 for a V placement; one line where S is odd."""
  if num_stages % 2:
    raise ValueError(f"num_stages={num_stages} is invalid for {name}; it "
                     "must be even (two chunks a device, a V placement)")
  return num_stages // 2


def zb_v(num_stages: int, num_microbatches: int,
         num_minibatches: int = 1) -> Schedule:
  """Builds ZB-V on P = S / 2 devices.

  Args:
    num_stages: S = 2P, even.
    num_microbatches: M.
    num_minibatches: B, minibatches in the table (a flush between them).

  Returns:
    The device-level schedule.

  Examples:
    >>> s = zb_v(num_stages=8, num_microbatches=8)
    >>> s.num_ticks, s.device_max_in_flight
    (51, (8, 8, 8, 8))
  """
  S, M = num_stages, num_microbatches
  P = v_devices("zb-v", S)
  n = max(2 * P - 1, M)

  def order(r):
    c0, c1 = r, S - 1 - r
    count = {}
    out = []

    def add(stage, *kinds):
      for kind in kinds:
        out.append((stage, kind, count.get((stage, kind), 0)))
        count[(stage, kind)] = count.get((stage, kind), 0) + 1

    for _ in range(2 * (P - r) - 1):
      add(c0, "F")
    for _ in range(r):
      add(c1, "F")
      add(c0, "F")
    for _ in range(P - r):
      add(c1, "F", "BI", "BW")
    while count.get((c1, "F"), 0) < count[(c0, "F")] or count[(c0, "F")] < n:
      if count[(c0, "F")] < n:
        add(c0, "F")
      add(c0, "BI", "BW")
      add(c1, "F", "BI", "BW")
    for _ in range(r):
      add(c0, "BI")
      add(c1, "BI")
    for _ in range(P - r):
      add(c0, "BI", "BW")
    for c in (c1, c0):
      while count.get((c, "BW"), 0) < count[(c, "BI")]:
        add(c, "BW")
    return [(a,) for a in out if a[2] < M]

  return ordered.build("zb-v", S, M, num_minibatches, placement="v",
                       num_devices=P, order=order)
