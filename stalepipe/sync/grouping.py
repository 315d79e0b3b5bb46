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
here `SyncGraph`: a union-find over component labels, the P-iteration
window sliding as a queue of two stacks, and the merges are the first group
of each component in time order). Deadlock prevention (§3.4):
an enforcement on one stage may not begin while an enforcement on another
stage is still waiting; such a validation is skipped for the iteration and
counted.

AD-PSGD (Lian et al. 2018): each iteration a random matching into pairs.
"""

import collections.abc
import functools

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

  @functools.cached_property
  def inner(self) -> np.ndarray:
    """`[N]` whether member `k` shares its group with member `k + 1`."""
    inner = np.ones(len(self.members), bool)
    inner[self.offsets[1:] - 1] = False
    return inner

  def labels(self, num_workers: int) -> np.ndarray:
    """`[N]` the group of each worker."""
    out = np.empty(num_workers, np.int64)
    out[self.members] = np.repeat(np.arange(len(self)), self.sizes)
    return out


def window_groups(ready: np.ndarray, window: float, min_size: int = 1
                  ) -> tuple[Groups, list]:
  """Groups of workers whose ready signals fall within `window` of the first.

  Algorithm 2 of seed 002: a group opens at the earliest waiting signal and
  closes `window` seconds later, or as soon as every worker still expected has
  joined. With `min_size` > 1, §4's adaptive timeout: a window that closes
  with fewer than `min_size` workers is enlarged until the `min_size`-th
  joins (and closes then); the paper enlarges it "slightly" and gives no
  threshold, so `min_size=1` (the default) keeps `T` fixed.

  Returns:
    `(groups, starts)`: the members of each group in time order, and when its
    averaging starts.

  Examples:
    >>> g, t = window_groups(np.array([0.0, 0.05, 1.0, 1.2]), 0.1)
    >>> [x.tolist() for x in g], t
    ([[0, 1], [2], [3]], [0.1, 1.1, 1.2])
    >>> g, t = window_groups(np.array([0.0, 0.05, 1.0, 1.2, 1.25]), 0.1, 2)
    >>> [x.tolist() for x in g], t
    ([[0, 1], [2, 3], [4]], [0.1, 1.2, 1.25])
  """
  order = np.argsort(ready, kind="stable")
  times = ready[order]
  n = len(order)
  after = np.searchsorted(times, times + window, side="right")
  grown = None
  if min_size > 1:  # the min_size-th signal from each one, and its ties
    enough = np.searchsorted(times, times[np.minimum(np.arange(n) + min_size,
                                                     n) - 1], side="right")
    grown = enough > after
    after = np.maximum(after, enough)
  nexts, firsts, i = after.tolist(), [], 0
  while i < n:
    firsts.append(i)
    i = nexts[i]
  heads = np.array(firsts, np.int64)
  starts = times[heads] + window
  if grown is not None:  # an enlarged window closes as its last member joins
    late = heads[grown[heads]]
    starts[grown[heads]] = times[after[late] - 1]
  starts[-1:] = times[-1:]  # the last group holds every worker still expected
  return Groups(order, np.append(heads, n)), starts.tolist()


def _join(labels: np.ndarray, count: int, members: np.ndarray,
          inner: np.ndarray) -> tuple[np.ndarray, int]:
  """Components of `labels` (`[N]` in `[0, count)`) joined with groups.

  The groups are runs of `members` (`inner[k]`: members `k` and `k + 1`
  share one, as `Groups.inner`); only pairs whose labels differ are edges,
  between labels, so the union-find runs over the few components rather
  than the workers.

  Returns:
    `(labels [N], count)`: labels in `[0, count)`, ordered as their smallest
    old label.
  """
  a = labels[members]
  cross = a[:-1] != a[1:]
  cross &= inner[:-1]
  edges = np.flatnonzero(cross).tolist()
  if not edges:
    return labels, count
  a = a.tolist()
  parent = list(range(count))  # each label's parent is a smaller label
  for k in edges:
    x, y = a[k], a[k + 1]
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    while parent[y] != y:
      parent[y] = parent[parent[y]]
      y = parent[y]
    if x < y:
      parent[y] = x
    elif y < x:
      parent[x] = y
  rank, count = parent, 0  # roots numbered in order, others as their root
  for c, up in enumerate(parent):
    if up == c:
      rank[c] = count
      count += 1
    else:
      rank[c] = rank[up]
  return np.array(rank)[labels], count


class SyncGraph:
  """The sync graph of one stage's last `size` rows (seed 002 §3.3): a row
  is the groups of one iteration (or one group, `Scheduler`'s
  `history_unit`), and the graph's edges join the members of each group.

  Its components, with one more row, are a union-find over component labels
  rather than workers: the window slides as a queue of two stacks, the older
  rows each joined with the rows after it up to the end of their stack, the
  newer ones joined as they come, so each row is joined about three times
  whatever `size` is.

  Examples:
    >>> g = SyncGraph(2, 4)
    >>> g.push(Groups(np.array([0, 1, 2, 3]), np.array([0, 2, 3, 4])))
    >>> labels, count = g.components(
    ...     Groups(np.array([1, 2, 0, 3]), np.array([0, 2, 3, 4])))
    >>> labels.tolist(), count
    ([0, 0, 0, 1], 2)
  """

  def __init__(self, size: int, num_workers: int):
    self.size, self.n = size, num_workers
    self.front = []  # (labels, count): oldest last, each joined to newer
    self.back = []  # Groups, oldest first
    self.newer = None  # (labels, count) of the rows in `back`

  def push(self, groups: Groups) -> None:
    """Adds a row, dropping the oldest beyond `size`."""
    if self.size == 0:
      return
    self.newer = (_join(*self.newer, groups.members, groups.inner)
                  if self.newer else (groups.labels(self.n), len(groups)))
    self.back.append(groups)
    if len(self.front) + len(self.back) <= self.size:
      return
    if not self.front:
      *rest, last = self.back
      joined = (last.labels(self.n), len(last))
      self.front = [joined]
      for row in reversed(rest):
        joined = _join(*joined, row.members, row.inner)
        self.front.append(joined)
      self.back, self.newer = [], None
    self.front.pop()

  def components(self, groups: Groups) -> tuple[np.ndarray, int]:
    """`(labels [N], count)` of the graph plus `groups`' edges."""
    if not self.front:
      if self.newer:
        return _join(*self.newer, groups.members, groups.inner)
      return groups.labels(self.n), len(groups)
    labels, count = self.front[-1]
    if not self.newer:
      return _join(labels, count, groups.members, groups.inner)
    newer = self.newer[0]  # its components as groups, then `groups`
    order = np.argsort(newer, kind="stable")
    ranked = newer[order]
    inner = np.empty(2 * self.n, bool)
    np.equal(ranked[1:], ranked[:-1], out=inner[:self.n - 1])
    inner[self.n - 1] = False
    inner[self.n:] = groups.inner
    return _join(labels, count, np.concatenate([order, groups.members]),
                 inner)


def enforce(groups: Groups, graph: SyncGraph) -> list[int]:
  """The groups that must wait for their predecessor so that `graph` plus
  `groups` is connected.

  In time order, the earliest group that does not share a component with
  the next one waits for it and they merge (seed 002 §3.4: "wait for more
  ready workers and re-generate the group"). Once merged, the groups seen
  so far are one component, so a group merges into its predecessor exactly
  when it is the first of its component.

  Args:
    groups: this iteration's groups, in time order.
    graph: the sync graph of the previous iterations.

  Returns:
    The indices of the groups that merge into the one before, increasing;
    empty when the graph is connected.

  Examples:
    >>> g, _ = window_groups(np.array([0.0, 1.0, 1.05]), 0.1)
    >>> enforce(g, SyncGraph(0, 3))
    [1]
  """
  if len(groups) == 1:
    return []
  comp, count = graph.components(groups)
  if count == 1:
    return []
  seen, waits = set(), []
  for j, head in enumerate(comp[groups.members[groups.offsets[:-1]]].tolist()):
    if head not in seen:
      seen.add(head)
      waits.append(j)
  return waits[1:]


def merge(groups: Groups, starts: list, waits: list[int]
          ) -> tuple[Groups, list]:
  """`groups` with each of `waits` merged into the group before; a merged
  group starts when its last part does.

  Examples:
    >>> g, t = merge(Groups(np.arange(3), np.arange(4)), [0.0, 1.0, 2.0], [1])
    >>> [x.tolist() for x in g], t
    ([[0, 1], [2]], [1.0, 2.0])
  """
  kept = np.ones(len(groups), bool)
  kept[waits] = False
  firsts = np.flatnonzero(kept)
  merged = np.maximum.reduceat(np.asarray(starts), firsts).tolist()
  offsets = np.append(groups.offsets[:-1][kept], len(groups.members))
  return Groups(groups.members, offsets), merged


HISTORY_UNITS = ("iteration", "group")


def check(history: int, window: float, min_size: int,
          history_unit: str) -> None:
  """Raises a one-line ValueError for an invalid P, T, `min_size` or unit."""
  if history_unit not in HISTORY_UNITS:
    raise ValueError(f"history_unit={history_unit!r} is invalid; valid: "
                     f"{', '.join(HISTORY_UNITS)}")
  if not isinstance(history, int) or history < 1:
    raise ValueError(f"history={history!r} is invalid; it must be an integer "
                     ">= 1")
  if not window >= 0:
    raise ValueError(f"window={window!r} is invalid; it must be >= 0 seconds")
  if not isinstance(min_size, int) or min_size < 1:
    raise ValueError(f"min_size={min_size!r} is invalid; it must be an "
                     "integer >= 1")


class Scheduler:
  """SDPipe's central scheduler: Algorithm 2 with §3.4's validation.

  Per stage it keeps the sync graph of the last P-1 iterations; a
  validation that would make a group wait while another stage's enforcement
  is still waiting is skipped (deadlock prevention) and recorded.

  With `history_unit="group"`, P counts group-sync operations (§3.2's clock
  k) instead: each group, in time order, is validated against the last P-1
  groups and waits for the next one of its iteration while the graph is
  disconnected; an iteration's last group has no later signal to wait for
  here and is kept as it is. Once a validation is skipped, the rest of the
  iteration's are (§3.4: "ignore later group validation operation in the
  current iteration").

  Examples:
    >>> sched = Scheduler(1, history=1, window=0.1)
    >>> groups, _ = sched.decide(0, 0, np.array([0.0, 1.0]))
    >>> [g.tolist() for g in groups]  # P=1: the two must form one group
    [[0, 1]]
  """

  def __init__(self, num_stages: int, history: int, window: float,
               enforce: bool = True, min_size: int = 1,
               history_unit: str = "iteration"):
    check(history, window, min_size, history_unit)
    self.window, self.enforce, self.history = window, enforce, history
    self.min_size = min_size  # §4's adaptive timeout (`window_groups`)
    self.history_unit = history_unit
    self.past = [None] * num_stages  # SyncGraph of the last P - 1 units
    self.waiting = {}  # stage -> (begin, end) of its last enforcement wait
    self.groups = [[] for _ in range(num_stages)]  # per stage, per iteration
    self.skipped = []  # (stage, iteration) whose validation was skipped

  def decide(self, stage: int, iteration: int, ready: np.ndarray
             ) -> tuple[Groups, list]:
    """This iteration's groups of `stage` and when each starts averaging."""
    if self.past[stage] is None:
      self.past[stage] = SyncGraph(self.history - 1, len(ready))
    groups, starts = window_groups(ready, self.window, self.min_size)
    if self.history_unit == "group":
      groups, starts = self._by_group(stage, iteration, groups, starts)
      self.groups[stage].append(groups)
      return groups, starts
    waits = enforce(groups, self.past[stage]) if self.enforce else []
    if waits:
      begin = starts[waits[0] - 1]  # the earliest group that waits
      if self._blocked(stage, begin):
        self.skipped.append((stage, iteration))
      else:
        groups, starts = merge(groups, starts, waits)
        self.waiting[stage] = (begin, max(starts))
    self.past[stage].push(groups)
    self.groups[stage].append(groups)
    return groups, starts

  def _blocked(self, stage: int, begin: float) -> bool:
    """Whether another stage's enforcement is still waiting at `begin`."""
    return any(s != stage and b <= begin < e
               for s, (b, e) in self.waiting.items())

  def _by_group(self, stage, iteration, groups, starts):
    """This iteration's groups validated one by one (`history_unit`)."""
    graph, n = self.past[stage], len(groups.members)
    waits, checking, begin = [], self.enforce, None
    first = 0  # the candidate: groups first..j
    for j in range(len(groups)):
      lo, hi = groups.offsets[first], groups.offsets[j + 1]
      alone = np.setdiff1d(np.arange(n), groups.members[lo:hi])
      row = Groups(np.concatenate([groups.members[lo:hi], alone]),
                   np.concatenate([[0], np.arange(hi - lo, n + 1)]))
      if checking and j + 1 < len(groups) and graph.components(row)[1] > 1:
        if begin is None and self._blocked(stage, starts[j]):
          self.skipped.append((stage, iteration))
          checking = False
        else:
          begin = starts[j] if begin is None else begin
          waits.append(j + 1)  # waits for the next group and merges
          continue
      graph.push(row)
      first = j + 1
    if not waits:
      return groups, starts
    groups, starts = merge(groups, starts, waits)
    self.waiting[stage] = (begin, max(starts))
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
