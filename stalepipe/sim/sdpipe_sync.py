"""SDPipe's semi-decentralized group scheduling, time side (seed 002 §3).

A central scheduler, one per stage, collects ready signals from the stage's
replicas (one per pipeline). Workers that signal within a window `T` of the
first form a group and average their models (Algorithm 2, §3.2); a group
that holds every worker still expected closes at once. The sync graph of the
last `P` iterations, whose edges join members of a group, must stay connected
(Assumption 1, §3.3): when this iteration's groups would break it, the
scheduler makes the earliest group that bridges two components wait for the
next group and merges them, until the graph is connected (§3.4, group
validation; tracked with union-find as the implementation in §4 does).

Deadlock prevention (§3.4): an enforcement on one stage may not begin while
an enforcement on another stage is still waiting; such a validation is
skipped for the iteration (the connectivity may be violated briefly) and
counted.

Grouping is per iteration: the replicas of stage `s` that finished minibatch
`p` are grouped among themselves (the global clock `k` of eq. 1). The
simulator processes events in dependency order, so a wait on another stage
is "still waiting" when its interval covers this stage's first ready time.
"""

import collections
import dataclasses
import math

import numpy as np

from stalepipe.sim import policy


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


class _SDPipeRunner(policy.Runner):

  def __init__(self, ctx, history, window):
    super().__init__(ctx)
    self.scheduler = Scheduler(ctx.cluster.num_stages, history, window)

  def sync(self, stage, minibatch, ready):
    groups, starts = self.scheduler.decide(stage, minibatch, ready)
    applied = ready.copy()
    synced, comm = [], []
    for g, t in zip(groups, starts):
      if len(g) > 1:
        end, event = policy.averaged(self.ctx, stage, g, t)
        synced.append(g)
        comm.append(event)
        applied[g] = end
      else:
        applied[g] = t
    return policy.SyncOutcome(applied, tuple(synced), tuple(comm))

  def extras(self):
    return {"sdpipe_groups": self.scheduler.groups,
            "sdpipe_skipped": self.scheduler.skipped}


@dataclasses.dataclass(frozen=True)
class SDPipe:
  """SDPipe's scheduler with connectivity budget `P` and window `T`.

  Attributes:
    history: P >= 1, iterations over which each stage's sync graph must be
      connected (seed 002 §5.1 uses 10).
    window: T in seconds, how long a group stays open (seed 002 §5.1 uses
      1/N of the iteration time); `math.inf` degrades to all-reduce.

  References:
    Miao et al, SDPipe: A Semi-Decentralized Framework for Heterogeneity-aware
    Pipeline-parallel Training <https://doi.org/10.14778/3598581.3598604>,
    2023, §3
  """

  history: int
  window: float
  name = "sdpipe"

  def __post_init__(self):
    if not isinstance(self.history, int) or self.history < 1:
      raise ValueError(f"history={self.history!r} is invalid; it must be an "
                       "integer >= 1")
    if not self.window >= 0:
      raise ValueError(f"window={self.window!r} is invalid; it must be >= 0 "
                       "seconds")

  def start(self, ctx: policy.Context) -> policy.Runner:
    return _SDPipeRunner(ctx, self.history, self.window)


def sdpipe(history: int = 10, window: float = math.inf) -> SDPipe:
  """SDPipe with connectivity budget P=`history` and window T=`window` seconds.

  Examples:
    >>> sdpipe(10, 0.05).window
    0.05
  """
  return SDPipe(history, window)
