"""SAPipe's partial staleness: the fewest leading layers that must be stale."""

from typing import Optional, Sequence

import numpy as np


def minimal_stale_prefix(
    forward_times: Sequence[float],
    backward_times: Sequence[float],
    comm_times: Sequence[float],
) -> Optional[int]:
  r"""The minimal k such that staling layers 1..k never stalls the pipeline.

  SAPipe §3.1 (Theorem 1: stale layers form a prefix) and the program after
  it, with :math:`u_i, b_i, v_i` the forward, backward and gradient
  communication times of layer :math:`i = 1..m`:

  .. math::
    \min k \ \text{s.t.}\ \sum_{i=1}^m v_i \le \sum_{i=1}^m (b_i + u_i),
    \qquad \sum_{l=k+1}^{i} v_l \le \sum_{l=1}^{i-1} b_l + \sum_{l=1}^{k} u_l
    \quad (i = k+1, \dots, m).

  The second family says the FIFO all-reduce of the fresh layers, each
  starting once its backward ends (backward runs :math:`m \to 1`), finishes
  before the next iteration's forward reaches layer :math:`k+1` (the
  deadline of every later fresh layer is no tighter). The paper prints the
  :math:`i = m` member; the others matter too: :math:`i = 1` alone forces
  :math:`k \ge 1`, since layer 1's all-reduce starts when the backward ends
  and the next forward starts at once, as Theorem 1 predicts. Enumerating k
  is :math:`O(m^2)`.

  Args:
    forward_times: :math:`u_1..u_m`, all > 0.
    backward_times: :math:`b_1..b_m`, all > 0.
    comm_times: :math:`v_1..v_m`, all > 0.

  Returns:
    The minimal k in 1..m, or `None` when communication exceeds computation
    (no k hides it).

  Examples:
    >>> minimal_stale_prefix([1, 1, 1], [1, 1, 1], [3, 1, 1])
    1
    >>> minimal_stale_prefix([1, 1, 1], [1, 1, 1], [1, 1, 3])
    2

  References:
    Chen et al, SAPipe (seed 004) §3.1, Theorem 1 and its program, 2022.
  """
  u, b, v = (np.asarray(t, np.float64) for t in (forward_times, backward_times,
                                                 comm_times))
  if not (u.ndim == 1 and u.shape == b.shape == v.shape and u.size):
    raise ValueError(f"times of shapes {u.shape}, {b.shape}, {v.shape} are "
                     "invalid; valid: three equal non-empty 1-D sequences")
  if (u <= 0).any() or (b <= 0).any() or (v <= 0).any():
    raise ValueError("a time <= 0 is invalid; valid: all times > 0")
  if v.sum() > b.sum() + u.sum():
    return None
  m = u.size
  cum_u = np.concatenate([[0.0], np.cumsum(u)])  # cum_u[k] = u_1 + .. + u_k
  cum_b = np.concatenate([[0.0], np.cumsum(b)])
  cum_v = np.concatenate([[0.0], np.cumsum(v)])
  # k = 0 never holds (v_1 > 0 cannot fit in no time) and k = m always does.
  return next(k for k in range(1, m + 1)
              if all(cum_v[i] - cum_v[k] <= cum_b[i - 1] + cum_u[k]
                     for i in range(k + 1, m + 1)))
