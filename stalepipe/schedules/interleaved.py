r"""Interleaved 1F1B: v chunks per device on a loop placement, depth first.

Narayanan et al (SC'21, §2.2) give each of P devices v non-consecutive
chunks (stage s on device s mod P, the "loop" placement), so a micro-batch
crosses the devices v times and the bubble shrinks v-fold. Each device
runs the order of torch's `ScheduleInterleaved1F1B`
(`torch/distributed/pipelining/schedules.py`, `_get_1f1b_rank_ops`): with
``rounds = max(1, M // P)`` and ``per_round = M // rounds`` (M a multiple
of ``rounds``), the k-th forward of device d runs chunk
``(k // per_round) mod v`` and the k-th backward chunk
``v - 1 - (k // per_round) mod v``, each chunk's micro-batches in order;
device d runs

.. math:: w_d = \min\left((v - 1)\,\mathrm{per\_round} + 2(P - 1 - d),\ vM\right)

forwards first, then one forward and one backward, then the last
:math:`w_d` backwards. With unit F and B per chunk and :math:`M` a multiple
of :math:`P` a minibatch takes

.. math:: 2(vM + P - 1)

ticks: the paper's :math:`(m + p - 1)\,(t_f + t_b)/v` per-device time with
:math:`m = M`, :math:`p = P` and a chunk's :math:`t_f/v = t_b/v = 1` tick,
a bubble of :math:`(P - 1)/(vM)` of the ideal :math:`2vM`.

References:
  Narayanan et al, Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM <https://arxiv.org/abs/2104.04473>, SC 2021
  (§2.2.2, Figure 4); torch.distributed.pipelining `ScheduleInterleaved1F1B`.
"""

from stalepipe.schedules import ordered
from stalepipe.schedules.core import Schedule


def device_chunks(name: str, num_stages: int, num_devices: int) -> int:
  """v, the chunks per device; one line where P does not divide S."""
  if num_devices < 1 or num_stages % num_devices:
    raise ValueError(f"num_devices={num_devices} is invalid for {name} with "
                     f"{num_stages} stages; valid: a divisor of {num_stages}")
  return num_stages // num_devices


def interleaved_1f1b(num_stages: int, num_microbatches: int,
                     num_minibatches: int = 1, *,
                     num_devices: int) -> Schedule:
  """Builds interleaved 1F1B on `num_devices` devices (v = S / P chunks each).

  Args:
    num_stages: S = v P, the chunks of all devices.
    num_microbatches: M, a multiple of ``max(1, M // P)``.
    num_minibatches: B, minibatches in the table (a flush between them).
    num_devices: P, devices on the loop placement.

  Returns:
    The device-level schedule.

  Examples:
    >>> s = interleaved_1f1b(num_stages=8, num_microbatches=8, num_devices=4)
    >>> s.num_ticks, s.device_max_in_flight
    (38, (11, 9, 7, 5))
  """
  S, M, P = num_stages, num_microbatches, num_devices
  v = device_chunks("interleaved-1f1b", S, P)
  rounds = max(1, M // P)
  if M % rounds:
    raise ValueError(f"num_microbatches={M} is invalid for interleaved-1f1b "
                     f"with {P} devices; it must be a multiple of "
                     f"max(1, M // P) = {rounds}")
  per_round = M // rounds

  def order(d):
    warmup = min((v - 1) * per_round + 2 * (P - 1 - d), v * M)
    forwards, backwards = [], []
    done_f, done_b = [0] * v, [0] * v
    for k in range(v * M):
      j = (k // per_round) % v
      forwards.append(((j * P + d, "F", done_f[j]),))
      done_f[j] += 1
      j = v - 1 - (k // per_round) % v
      backwards.append(((j * P + d, "B", done_b[j]),))
      done_b[j] += 1
    steady = v * M - warmup
    out = forwards[:warmup]
    for k in range(steady):
      out += [forwards[warmup + k], backwards[k]]
    return out + backwards[steady:]

  return ordered.build("interleaved-1f1b", S, M, num_minibatches,
                       placement="loop", num_devices=P, order=order)
