"""Bulk synchronous parallel: all-reduce every gradient before its update."""

from stalepipe.sync import base


class BSP(base.SyncPolicy):
  """All replicas average each minibatch's gradient, then update identically.

  .. math:: x_{t+1} = x_t - \\gamma \\frac{1}{D} \\sum_d g_t^{(d)}

  References:
    Valiant, A bridging model for parallel computation, CACM 1990; seed 002
    §2.1 (AllReduce).
  """

  name = "bsp"
  average_gradients = True


def bsp(num_replicas: int) -> BSP:
  """BSP over `num_replicas` replicas.

  Examples:
    >>> bsp(4).average_gradients
    True
  """
  return BSP(num_replicas)
