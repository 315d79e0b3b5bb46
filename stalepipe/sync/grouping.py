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
connected (§3.4, group validation; §4 tracks components with union-find,
here parallel union-find in NumPy over the last P iterations' group labels,
and one scan in time order finds every merge). Deadlock prevention (§3.4):
an enforcement on one stage may not begin while an enforcement on another
stage is still waiting; such a validation is skipped for the iteration and
counted.

AD-PSGD (Lian et al. 2018): each iteration a random matching into pairs.
"""

import collections.abc

import numpy as np


class Groups(collections.abc.Sequence):
  """Disjoint groups of workers, in time order: a sequence of index arrays.

  Stored as the members of every group one after another and each group's
  first position, so that a scheduler deciding thousands of iterations keeps
  two arrays per iteration.

  Examples:
    >>> g = Groups(np.array([2, 0, 1]), np.array([0, 2, 3]))
    >>> [x.tolist() for x in g], g.sizes.tolist()
    ([[2, 0], [1]], [2, 1])
  """

  def __init__(self, members: np.ndarray, offsets: np.ndarray):
    self.members = members  # [N] int, group by group
    self.offsets = offsets  # [groups + 1] int, where each group begins

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, k):
    if not -len(self) <= k < len(self):
      raise IndexError(f"group {k} of {len(self)}")
    k %= len(self)
    return self.members[self.offsets[k]:self.offsets[k + 1]]

  @property
  def sizes(self) -> np.ndarray:
    return np.diff(self.offsets)

  def labels(self, num_workers: int) -> np.ndarray:
    """`[N]` the group of each worker."""
    out = np.empty(num_workers, np.int64)
    out[self.members] = np.repeat(np.arange(len(self)), self.sizes)
    return out


def window_groups(ready: np.ndarray, window: float) -> tuple[Groups, list]:
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
  n = len(order)
  closes = (times + window).tolist()
  after = np.searchsorted(times, times + window, side="right").tolist()
  firsts, starts = [], []
  i = 0
  while i < n:
    j = after[i]
    firsts.append(i)
    starts.append(float(times[j - 1]) if j == n else closes[i])
    i = j
  firsts.append(n)
  return Groups(order, np.array(firsts)), starts


def components(labels: np.ndarray) -> tuple[np.ndarray, int]:
  """Components of the graph joining workers that share a label in any row.

  Each group is a path through its members (the edges); every round hooks
  the root of each edge's endpoints to the smaller of the two and then
  jumps pointers until every worker points at a root, as parallel
  union-find does (Shiloach and Vishkin, An O(log n) parallel connectivity
  algorithm, 1982): a few NumPy passes over the edges however long the sync
  graph's paths grow.

  Args:
    labels: `[rows, N]` non-negative ints, distinct across rows (each row a
      partition of the workers, e.g. one iteration's groups).

  Returns:
    `(component [N], count)`: equal ids for workers of one component.

  Examples:
    >>> c, n = components(np.array([[0, 0, 1, 2], [3, 4, 5, 5]]))
    >>> c.tolist(), n
    ([0, 0, 2, 2], 2)
  """
  N = labels.shape[1]
  order = np.argsort(labels, axis=None, kind="stable")
  ranked = labels.ravel()[order]
  same = ranked[1:] == ranked[:-1]
  u, v = order[:-1][same] % N, order[1:][same] % N
  comp = np.arange(N)
  while True:
    cu, cv = comp[u], comp[v]
    low = np.minimum(cu, cv)
    new = comp.copy()
    np.minimum.at(new, cu, low)
    np.minimum.at(new, cv, low)
    while True:
      jumped = new[new]
      if np.array_equal(jumped, new):
        break
      new = jumped
    if np.array_equal(new, comp):
      break
    comp = new
  return comp, int(np.count_nonzero(comp == np.arange(N)))


def enforce(groups: Groups, starts: list, history: np.ndarray,
            num_workers: int) -> tuple[Groups, list, float | None]:
  """Merges groups in time order until `history + groups` is connected.

  The earliest group that does not share a component with the next one waits
  for it (seed 002 §3.4: "wait for more ready workers and re-generate the
  group").

  Args:
    groups: this iteration's groups, in time order.
    starts: when each group's averaging starts.
    history: `[P - 1, N]` the group labels (`Groups.labels`) of the
      previous iterations, one row each.
    num_workers: N, the replicas of the stage.

  Returns:
    `(groups, starts, waited_from)`: `waited_from` is the original start of
    the earliest group that had to wait, None when none did.

  Examples:
    >>> g, _ = window_groups(np.array([0.0, 1.0]), 0.1)
    >>> g, t, w = enforce(g, [0.0, 1.0], np.zeros((0, 2), int), 2)
    >>> [x.tolist() for x in g], t, w
    ([[0, 1]], [1.0], 0.0)
  """
  sizes = groups.sizes
  if (sizes == num_workers).any():
    return groups, starts, None
  rows = np.concatenate([history, groups.labels(num_workers)[None]])
  rows += (num_workers * np.arange(len(rows)))[:, None]  # distinct per row
  comp, count = components(rows)
  if count == 1:
    return groups, starts, None
  # Merging groups j and j+1 unites their components; the groups before j
  # stay in one component each with their successor, so one scan in time
  # order finds every merge, and only where the component changes.
  heads = comp[groups.members[groups.offsets[:-1]]]
  changes = (np.flatnonzero(heads[1:] != heads[:-1]) + 1).tolist()
  parent = {}

  def find(c):
    while parent.get(c, c) != c:
      c = parent[c]
    return c

  heads = heads.tolist()
  kept = np.ones(len(groups), bool)
  run, waited_from = 0, None  # run: where the group before j begins
  for j in changes:
    here, there = find(heads[j - 1]), find(heads[j])
    if count > 1 and here != there:
      if kept[j - 1]:
        run = j - 1
      waited = max(starts[run:j])
      if waited_from is None or waited < waited_from:
        waited_from = waited
      parent[there] = here
      count -= 1
      kept[j] = False
  firsts = np.flatnonzero(kept)
  merged = np.maximum.reduceat(np.asarray(starts), firsts).tolist()
  offsets = np.append(groups.offsets[:-1][kept], num_workers)
  return Groups(groups.members, offsets), merged, waited_from


class Scheduler:
  """SDPipe's central scheduler: Algorithm 2 with §3.4's validation.

  Per stage it keeps the group labels of the last P-1 iterations; a
  validation that would make a group wait while another stage's enforcement
  is still waiting is skipped (deadlock prevention) and recorded.

  Examples:
    >>> sched = Scheduler(1, history=1, window=0.1)
    >>> groups, _ = sched.decide(0, 0, np.array([0.0, 1.0]))
    >>> [g.tolist() for g in groups]  # P=1: the two must form one group
    [[0, 1]]
  """

  def __init__(self, num_stages: int, history: int, window: float,
               enforce: bool = True):
    self.window, self.enforce, self.history = window, enforce, history
    self.past = [None] * num_stages  # [P - 1, N] labels, oldest first
    self.waiting = {}  # stage -> (begin, end) of its last enforcement wait
    self.groups = [[] for _ in range(num_stages)]  # per stage, per iteration
    self.skipped = []  # (stage, iteration) whose validation was skipped

  def decide(self, stage: int, iteration: int, ready: np.ndarray
             ) -> tuple[Groups, list]:
    """This iteration's groups of `stage` and when each starts averaging."""
    n = len(ready)
    if self.past[stage] is None:
      self.past[stage] = np.zeros((0, n), np.int64)
    groups, starts = window_groups(ready, self.window)
    if self.enforce:
      checked, checked_starts, begin = enforce(groups, starts,
                                               self.past[stage], n)
      if begin is not None:
        if any(s != stage and b <= begin < e
               for s, (b, e) in self.waiting.items()):
          self.skipped.append((stage, iteration))
        else:
          self.waiting[stage] = (begin, max(checked_starts))
          groups, starts = checked, checked_starts
    rows = np.concatenate([self.past[stage], groups.labels(n)[None]])
    self.past[stage] = rows[max(0, len(rows) - (self.history - 1)):]
    self.groups[stage].append(groups)
    return groups, starts


def random_pairs(num_pipelines: int, rng: np.random.Generator,
                 matched_only: bool = False) -> list[np.ndarray] | np.ndarray:
  """A random matching of the pipelines into pairs (one left alone if odd).

  Args:
    num_pipelines: N.
    rng: draws one permutation.
    matched_only: return the pairs alone, as one `[N // 2, 2]` array.

  Examples:
    >>> sorted(len(g) for g in random_pairs(5, np.random.default_rng(0)))
    [1, 2, 2]
    >>> random_pairs(5, np.random.default_rng(0), matched_only=True).shape
    (2, 2)
  """
  order = rng.permutation(num_pipelines)
  if matched_only:
    return order[:num_pipelines // 2 * 2].reshape(-1, 2)
  return [order[k:k + 2] for k in range(0, num_pipelines, 2)]
