"""Model averaging without a scheduler: AD-PSGD pairs and local SGD."""

import numpy as np

from stalepipe.sync import base
from stalepipe.sync import grouping


class ADPSGD(base.SyncPolicy):
  """After every update, replicas average with one random partner.

  All stages of an iteration use the same seeded random matching (one replica
  is left alone when D is odd).

  References:
    Lian et al, Asynchronous Decentralized Parallel Stochastic Gradient
    Descent <https://arxiv.org/abs/1710.06952>, 2018; seed 002 §5.1.
  """

  name = "ad_psgd"

  def __init__(self, num_replicas: int, seed: int = 0):
    super().__init__(num_replicas)
    self.seed = seed

  def mixing(self, stage: int, minibatch: int) -> np.ndarray:
    del stage
    rng = np.random.default_rng([self.seed, minibatch])
    return base.group_mixing(grouping.random_pairs(self.num_replicas, rng),
                             self.num_replicas)


class LocalSGD(base.SyncPolicy):
  """Replicas train alone and average all weights every `period` minibatches.

  References:
    Stich, Local SGD Converges Fast and Communicates Little
    <https://arxiv.org/abs/1805.09767>, 2019.
  """

  name = "local_sgd"

  def __init__(self, num_replicas: int, period: int):
    super().__init__(num_replicas)
    if not isinstance(period, int) or period < 1:
      raise ValueError(f"period={period!r} is invalid; it must be an integer "
                       ">= 1")
    self.period = period

  def mixing(self, stage: int, minibatch: int) -> np.ndarray | None:
    del stage
    if (minibatch + 1) % self.period:
      return None
    return base.group_mixing([range(self.num_replicas)], self.num_replicas)


def ad_psgd(num_replicas: int, seed: int = 0) -> ADPSGD:
  """AD-PSGD's random pairwise averaging (see `ADPSGD`).

  Examples:
    >>> ad_psgd(4).mixing(0, 0).sum(axis=1)
    array([1., 1., 1., 1.], dtype=float32)
  """
  return ADPSGD(num_replicas, seed)


def local_sgd(num_replicas: int, period: int) -> LocalSGD:
  """Local SGD with averaging every `period` minibatches (see `LocalSGD`).

  Examples:
    >>> local_sgd(2, period=4).mixing(0, 2) is None
    True
  """
  return LocalSGD(num_replicas, period)
