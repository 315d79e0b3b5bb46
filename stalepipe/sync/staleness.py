"""Observed staleness of a schedule run under a sync policy.

HetPipe's measure (seed 001 §5): minibatch p of a replica has observed
staleness `p - r`, with `r` the longest prefix of minibatches whose updates,
from every replica, the weights its forwards read reflect. Within one
pipeline it is the schedule's `p - version`; across pipelines it adds what
the policy has not delivered yet (WSP's global waves, SDPipe's groups).

Every weight version is summarised by one number per replica: the prefix of
that replica's minibatches it reflects. Own updates land in order; BSP
reflects every replica's minibatch at once; a WSP pull of waves up to `w`
reflects every replica's minibatches before `(w+1) N_m`; averaging in a group
reflects what any member reflected (in part, through the average). The
oracle (`stalepipe.pipeline.reference`) tracks the same with explicit sets.
"""

import numpy as np

from stalepipe.schedules import Schedule
from stalepipe.schedules import tiling
from stalepipe.sync import base

_BUILT = 48  # minibatches built directly; longer streams tile the steady state


def observed_staleness(schedule: Schedule, policy: base.SyncPolicy,
                       num_minibatches: int) -> np.ndarray:
  """`[replicas, minibatches]`: each minibatch's observed staleness.

  Args:
    schedule: the schedule (its window); it is rebuilt over
      `num_minibatches` (long streams by tiling its steady state).
    policy: the sync policy across the replicas.
    num_minibatches: how many minibatches of the stream to report.

  Returns:
    The largest `p - r` over the forwards of minibatch `p` on any stage.

  Examples:
    >>> import stalepipe as sp
    >>> s = sp.schedules.make("hetpipe", num_stages=4, num_microbatches=1,
    ...                       concurrent_minibatches=4)
    >>> int(observed_staleness(s, sp.sync.wsp(2, 0, 4), 24).max())  # s_global
    6
  """
  short = schedule.with_minibatches(min(num_minibatches, _BUILT))
  stream = (short if num_minibatches <= _BUILT
            else tiling.tile(short, num_minibatches))
  D, S = policy.num_replicas, stream.num_stages
  prefixes = {(d, s): [np.zeros(D, np.int64)] for d in range(D)
              for s in range(S)}  # per version: reflected prefix per replica
  staleness = np.zeros((D, num_minibatches), np.int64)
  tasks, updates = {}, {}
  for t in stream.tasks:
    tasks.setdefault(t.tick, []).append(t)
  for (s, p), u in stream.update_ticks.items():
    updates.setdefault(u, []).append((s, p))
  for tick in range(stream.num_ticks):
    for t in tasks.get(tick, ()):
      if stream.kind(t).runs_forward:
        v = stream.task_version(t)
        for d in range(D):
          seen = prefixes[(d, t.stage)][v]
          staleness[d, t.minibatch] = max(staleness[d, t.minibatch],
                                          t.minibatch - seen.min())
    for s, p in updates.get(tick, ()):
      new = [prefixes[(d, s)][-1].copy() for d in range(D)]
      for d in range(D):
        new[d][d] = max(new[d][d], p + 1)
        if policy.average_gradients:
          new[d][:] = np.maximum(new[d], p + 1)
      if policy.wave and (p + 1) % policy.wave == 0:
        c = p // policy.wave
        for d in range(D):
          pulled = (c - policy.wave_delay(c)[d] + 1) * policy.wave
          new[d][:] = np.maximum(new[d], pulled)
      mixing = policy.mixing(s, p)
      if mixing is not None:
        new = [np.max([new[e] for e in range(D) if mixing[d, e]], axis=0)
               for d in range(D)]
      for d in range(D):
        prefixes[(d, s)].append(new[d])
  return staleness


class ObservedStaleness:
  """`observed_staleness` computed as far as it is read, doubling its reach.

  A training run reads minibatch p's observed staleness when it logs p's
  window. Building the whole stream up front costs time and memory in
  proportion to the run's length (a 400,000-minibatch PipeDream stream:
  about 2 minutes and 5 GB before the first step); this builds the first
  `first` minibatches, and a longer stream, twice as long, only when a read
  goes past it. Each value equals `observed_staleness(schedule, policy, n)`'s
  for any `n` beyond it: the stream does not look ahead.

  Examples:
    >>> import stalepipe as sp
    >>> s = sp.schedules.make("pipedream", num_stages=2, num_microbatches=2)
    >>> lazy = ObservedStaleness(s, sp.sync.bsp(1), 10_000_000, first=64)
    >>> lazy[:, 8:10].tolist(), lazy.built
    ([[1, 1]], 64)
  """

  def __init__(self, schedule: Schedule, policy: base.SyncPolicy,
               num_minibatches: int, first: int = 1024):
    self.schedule, self.policy = schedule, policy
    self.num_minibatches = num_minibatches
    self.built, self._values = 0, None
    self._first = first

  def __getitem__(self, index) -> np.ndarray:
    """`[replicas, minibatches]` rows and columns, as a NumPy slice; columns
    must be a slice with an explicit stop."""
    rows, cols = index
    if min(cols.stop, self.num_minibatches) > self.built:
      n = max(self._first, self.built)
      while n < cols.stop:
        n *= 2
      self.built = min(n, self.num_minibatches)
      self._values = observed_staleness(self.schedule, self.policy,
                                        self.built)
    return self._values[rows, cols]
