"""SDPipe's central scheduler and random pairings: who averages with whom.

Pure NumPy, shared by the numeric side (`stalepipe.sync`: the executors
replay the groups) and the time side (`stalepipe.sim`: the simulator decides
them from simulated ready times).

SDPipe (seed 002 §3): a central scheduler, one per stage, collects ready
signals from the stage's replicas (one per pipeline). Workers that signal
within a window `T` of the first form a group and average their models
(Algorithm 2, §3.2); a group that holds every worker still expected closes at
once. The sync graph of the last `P` iterations, whose edges join members of
a group, must stay connected (Assumption 1, §3.3): when this iteration's
groups would break it, the scheduler makes the earliest group that bridges
two components wait for the next group and merges them, until the graph is
connected (§3.4, group validation; tracked with union-find as the
implementation in §4 does). Deadlock prevention (§3.4): an enforcement on one
stage may not begin while an enforcement on another stage is still waiting;
such a validation is skipped for the iteration and counted.

AD-PSGD (Lian et al. 2018): each iteration a random matching into pairs.
"""

import collections

import numpy as np


class UnionFind:
  """Disjoint sets over `0..n-1` with path halving.

  Examples:
    >>> uf = UnionFind(3)
    >>> uf.union(0, 2); uf.find(2) == uf.find(0), uf.components
    (True, 2)
  """

  def __init__(self, n: int):
    self.parent = list(range(n))
    self.components = n

  def copy(self) -> "UnionFind":
    other = UnionFind(0)
    other.parent, other.components = list(self.parent), self.components
    return other

  def find(self, x: int) -> int:
    parent = self.parent
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  def union(self, a: int, b: int) -> None:
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[ra] = rb
      self.components -= 1


def sync_graph(num_workers: int, groups, uf: UnionFind | None = None
               ) -> UnionFind:
  """The components of the sync graph whose edges join members of a group.

  Args:
    num_workers: N, the nodes.
    groups: sequences of worker ids.
    uf: components to start from (copied), default all apart.

  Returns:
    The components.
  """
  uf = UnionFind(num_workers) if uf is None else uf.copy()
  for g in groups:
    members = g.tolist() if isinstance(g, np.ndarray) else list(g)
    for w in members[1:]:
      uf.union(members[0], w)
  return uf


def window_groups(ready: np.ndarray, window: float
                  ) -> tuple[list[np.ndarray], list[float]]:
  """Groups of workers whose ready signals fall within `window` of the first.

  Algorithm 2 of seed 002: a group opens at the earliest waiting signal and
  closes `window` seconds later, or as soon as every worker still expected has
  joined.

  Returns:
    `(groups, starts)`: the members of each group in time order, and when its
    averaging starts.

  Examples:
    >>> g, t = window_groups(np.array([0.0, 0.05, 1.0, 1.2]), 0.1)
    >>> [x.tolist() for x in g], t
    ([[0, 1], [2], [3]], [0.1, 1.1, 1.2])
  """
  order = np.argsort(ready, kind="stable")
  times = ready[order]
  groups, starts = [], []
  i = 0
  while i < len(order):
    j = int(np.searchsorted(times, times[i] + window, side="right"))
    groups.append(order[i:j])
    starts.append(float(times[j - 1]) if j == len(order) else
                  float(times[i] + window))
    i = j
  return groups, starts


def enforce(groups: list[np.ndarray], starts: list[float], history,
            num_workers: int
            ) -> tuple[list[np.ndarray], list[float], float | None]:
  """Merges groups in time order until `history + groups` is connected.

  The earliest group that does not share a component with the next one waits
  for it (seed 002 §3.4: "wait for more ready workers and re-generate the
  group").

  Args:
    groups: this iteration's groups, in time order.
    starts: when each group's averaging starts.
    history: the group lists of the previous `P - 1` iterations.
    num_workers: N, the replicas of the stage.

  Returns:
    `(groups, starts, waited_from)`: `waited_from` is the original start of
    the earliest group that had to wait, None when none did.

  Examples:
    >>> g, t, w = enforce([np.array([0]), np.array([1])], [0.0, 1.0], [], 2)
    >>> [x.tolist() for x in g], t, w
    ([[0, 1]], [1.0], 0.0)
  """
  groups, starts, waited_from = list(groups), list(starts), None
  if any(len(g) == num_workers for g in groups):
    return groups, starts, waited_from
  past = sync_graph(num_workers, [g for it in history for g in it])
  while True:
    uf = sync_graph(num_workers, groups, past)
    if uf.components == 1:
      return groups, starts, waited_from
    for j in range(len(groups) - 1):
      if uf.find(int(groups[j][0])) != uf.find(int(groups[j + 1][0])):
        if waited_from is None or starts[j] < waited_from:
          waited_from = starts[j]
        groups[j:j + 2] = [np.concatenate(groups[j:j + 2])]
        starts[j:j + 2] = [max(starts[j:j + 2])]
        break


class Scheduler:
  """SDPipe's central scheduler: Algorithm 2 with §3.4's validation.

  Per stage it keeps the groups of the last P-1 iterations; a validation that
  would make a group wait while another stage's enforcement is still waiting
  is skipped (deadlock prevention) and recorded.

  Examples:
    >>> sched = Scheduler(1, history=1, window=0.1)
    >>> groups, _ = sched.decide(0, 0, np.array([0.0, 1.0]))
    >>> [g.tolist() for g in groups]  # P=1: the two must form one group
    [[0, 1]]
  """

  def __init__(self, num_stages: int, history: int, window: float,
               enforce: bool = True):
    self.window, self.enforce = window, enforce
    self.past = [collections.deque(maxlen=history - 1)
                 for _ in range(num_stages)]
    self.waiting = {}  # stage -> (begin, end) of its last enforcement wait
    self.groups = [[] for _ in range(num_stages)]  # per stage, per iteration
    self.skipped = []  # (stage, iteration) whose validation was skipped

  def decide(self, stage: int, iteration: int, ready: np.ndarray
             ) -> tuple[list[np.ndarray], list[float]]:
    """This iteration's groups of `stage` and when each starts averaging."""
    groups, starts = window_groups(ready, self.window)
    if self.enforce:
      checked, checked_starts, begin = enforce(groups, starts,
                                               self.past[stage], len(ready))
      if begin is not None:
        if any(s != stage and b <= begin < e
               for s, (b, e) in self.waiting.items()):
          self.skipped.append((stage, iteration))
        else:
          self.waiting[stage] = (begin, max(checked_starts))
          groups, starts = checked, checked_starts
    self.past[stage].append(groups)
    self.groups[stage].append(groups)
    return groups, starts


def random_pairs(num_pipelines: int, rng: np.random.Generator
                 ) -> list[np.ndarray]:
  """A random matching of the pipelines into pairs (one left alone if odd).

  Examples:
    >>> sorted(len(g) for g in random_pairs(5, np.random.default_rng(0)))
    [1, 2, 2]
  """
  order = rng.permutation(num_pipelines)
  return [order[k:k + 2] for k in range(0, num_pipelines, 2)]
