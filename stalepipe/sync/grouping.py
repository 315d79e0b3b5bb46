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
here `SyncWindow`: a union-find over component labels, the P-iteration
window sliding in blocks, and the merges are the first group of each
component in time order). Deadlock prevention (§3.4): an enforcement on one
stage may not begin while an enforcement on another stage is still waiting;
such a validation is skipped for the iteration and counted.

The stages of one iteration are decided together (`Scheduler.decide_many`):
their window groups and sync graphs are a few NumPy calls over all of them,
and only the deadlock rule runs stage by stage. `Scheduler` groups the
replicas that finished the same iteration; `ArrivalScheduler` groups whoever
signals within T, whatever iteration each is at (Algorithm 2 as written; the
simulator only, since the lockstep executor cannot average one replica's
iteration with another's next).

AD-PSGD (Lian et al. 2018): each iteration a random matching into pairs.
"""

import bisect
import collections
import collections.abc
import functools
import math
from typing import NamedTuple

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


class Batch(NamedTuple):
  """The window groups of several rows at once (a row: one stage's ready
  signals), stacked: row `r`'s worker `w` is position `r * n + w`."""

  groups: list  # [k] Groups, each row's groups in time order
  starts: list  # [k] float arrays: when each group starts averaging
  members: np.ndarray  # [k, n] int, each row's workers group by group
  positions: np.ndarray  # [k * n] int, `members` as positions
  inner: np.ndarray  # [k * n] bool, `Groups.inner` of each row
  heads: np.ndarray  # [G] int, where each group begins in `positions`
  first: np.ndarray  # [k + 1] int, each row's first group in `heads`
  start: np.ndarray  # [G] float, `starts` one row after another


def stacked(groups: list, starts: list, members: np.ndarray) -> Batch:
  """The `Batch` of each row's `groups` and `starts` (`members`: `[k, n]`,
  each row's `Groups.members`)."""
  k, n = members.shape
  heads = np.concatenate([g.offsets[:-1] + r * n
                          for r, g in enumerate(groups)])
  first = np.zeros(k + 1, np.int64)
  np.cumsum([len(g) for g in groups], out=first[1:])
  return Batch(groups, starts, members,
               (members + np.arange(0, k * n, n)[:, None]).ravel(),
               np.concatenate([g.inner for g in groups]), heads, first,
               np.concatenate(starts))


def window_batch(ready: np.ndarray, window: float, min_size: int = 1
                 ) -> Batch:
  """`window_groups` of each row of `ready` (`[k, n]`), stacked (`Batch`).

  A signal more than `window` after the one before always opens a group,
  and a run between two such gaps that spans at most `window` is one group,
  so only the longer runs are walked one signal at a time; with `min_size`
  > 1 every row is, by each group's first signal after its window.
  """
  k, n = ready.shape
  order = np.argsort(ready, axis=1, kind="stable")
  positions = (order + np.arange(0, k * n, n)[:, None]).ravel()
  times = ready.ravel()[positions]
  closes = times + window  # when a group opened by each signal closes
  head = np.zeros(k * n, bool)
  if min_size > 1:
    closes = _grown_heads(times.reshape(k, n), closes.reshape(k, n),
                          min_size, head.reshape(k, n)).ravel()
  else:
    np.greater(times[1:], closes[:-1], out=head[1:])
    head[::n] = True
    runs = np.flatnonzero(head)
    ends = np.empty_like(runs)
    ends[:-1] = runs[1:]
    ends[-1] = k * n
    ends -= 1
    long = np.flatnonzero(times[ends] > closes[runs])
    if len(long):
      head[_walk(times, closes, runs[long], ends[long])] = True
  heads = np.flatnonzero(head)
  first = np.searchsorted(heads, np.arange(0, k * n + 1, n))
  starts = closes[heads]
  starts[first[1:] - 1] = times[n - 1::n]  # the last holds every worker left
  inner = np.empty(k * n, bool)
  np.logical_not(head[1:], out=inner[:-1])
  inner[-1] = False
  bounds = first + np.arange(k + 1)  # each row's offsets, its n included
  offsets = np.empty((k, n + 1), bool)
  offsets[:, :n] = head.reshape(k, n)
  offsets[:, n] = True
  offsets = np.nonzero(offsets)[1]
  return Batch([Groups(order[r], offsets[bounds[r]:bounds[r + 1]])
                for r in range(k)],
               [starts[first[r]:first[r + 1]] for r in range(k)],
               order, positions, inner, heads, first, starts)


def _walk(times: np.ndarray, closes: np.ndarray, runs: np.ndarray,
          ends: np.ndarray) -> list[int]:
  """The signals after the first of each run `runs[i]..ends[i]` that open a
  group: each one after the window of the last opened."""
  sizes = ends - runs + 1
  before = np.cumsum(sizes) - sizes  # each run's first in the lists
  at = np.repeat(runs - before, sizes) + np.arange(before[-1] + sizes[-1])
  t, c = times[at].tolist(), closes[at].tolist()
  more = []
  for a, lo, size in zip(runs.tolist(), before.tolist(), sizes.tolist()):
    close = c[lo]
    for i in range(lo + 1, lo + size):
      if t[i] > close:
        more.append(a + i - lo)
        close = c[i]
  return more


def _grown_heads(times: np.ndarray, closes: np.ndarray, min_size: int,
                 head: np.ndarray) -> np.ndarray:
  """Marks in `head` (`[k, n]`) the signals that open a group under §4's
  adaptive timeout, and returns when a group opened by each signal closes
  (`[k, n]`)."""
  k, n = times.shape
  out = closes.copy()
  for r in range(k):
    t = times[r]
    after = np.searchsorted(t, closes[r], side="right")
    # the min_size-th signal from each one, and its ties
    enough = np.searchsorted(t, t[np.minimum(np.arange(n) + min_size, n) - 1],
                             side="right")
    grown = enough > after  # then it closes as its last member joins
    after = np.maximum(after, enough)
    out[r, grown] = t[after[grown] - 1]
    nexts, i = after.tolist(), 0
    while i < n:
      head[r, i] = True
      i = nexts[i]
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
  batch = window_batch(np.asarray(ready)[None], window, min_size)
  return batch.groups[0], batch.starts[0].tolist()


class SyncWindow:
  """The sync graphs of every stage over its last `size` rows (seed 002
  §3.3): a row is the groups of one iteration (or one group, `Scheduler`'s
  `history_unit`), and the graph's edges join the members of each group.

  Its components are labels, one per worker, joined with a row's groups by a
  union-find over the labels rather than the workers (`_join`). The window
  slides in blocks of `size` rows: it keeps the components of the current
  block's rows so far (`prefix`, one join per row) and of every suffix of the
  last complete block (`suffix`, built backwards when a block completes: one
  join per row), so the last `size` rows are one suffix and one prefix, and
  a question about them one join more. Stages at the same point of their
  window go through each step together, stacked (row `r` of a batch is
  positions `r * n ...`); labels are global (stage `s`'s are `s * n ... s * n
  + n - 1`), so the stages' components never meet.

  Examples:
    >>> w = SyncWindow(num_stages=1, size=2, num_workers=4)
    >>> members = np.array([[0, 1, 2, 3]])
    >>> inner = np.array([1, 0, 0, 0], bool)  # (0, 1), (2), (3)
    >>> w.push([0], members, inner, w.joined([0], members[0], inner))
    >>> inner = np.array([0, 1, 0, 0], bool)  # (0), (1, 2), (3)
    >>> labels = w.components([0], w.joined([0], members[0], inner))
    >>> (labels == labels[0]).tolist()  # 0-1 before, 1-2 now; 3 alone
    [True, True, True, False]
  """

  def __init__(self, num_stages: int, size: int, num_workers: int):
    S, n = num_stages, num_workers
    self.size, self.n = size, n
    self.ids = np.arange(S * n).reshape(S, n)  # every worker alone
    self.pushed = [0] * S  # rows each stage pushed
    rows = max(size, 1)
    self.prefix = self.ids.copy()  # [S, n] labels: the block's rows so far
    self.suffix = np.empty((S, rows, n), np.int64)  # [s, i]: rows i.. of
    #   the last complete block
    self.members = np.empty((S, rows, n), np.int64)  # the block's rows (as
    self.inner = np.empty((S, rows, n), bool)  # `Batch.members`, `inner`)
    self._parent = list(range(S * n))  # the union-find, identity between

  def joined(self, stages: list, positions: np.ndarray, inner: np.ndarray
             ) -> np.ndarray:
    """`[k * n]` components of each stage's current block so far plus one
    row (`positions`, `inner`: `[k * n]`, as `Batch`'s)."""
    if self._point(stages)[0]:
      return self._join(self.prefix[stages].ravel(), positions, inner)
    return self._labels(stages, positions, inner)

  def components(self, stages: list, joined: np.ndarray) -> np.ndarray:
    """`[k * n]` labels of the last `size` rows plus the row of `joined`
    (`joined`'s result): workers share a label iff connected."""
    j, full = self._point(stages)
    if not full:
      return joined
    older = self.suffix[stages, j].ravel()  # size - j rows
    coarse, fine = (older, joined) if self.size - j > j else (joined, older)
    # Each worker's label joined with that of one member of its finer
    # component (whichever: the components are the same), so that the
    # union-find over the coarser labels (a few large components) sees few
    # edges.
    member = np.empty(self.ids.size, np.int64)
    member[fine] = coarse
    other = member[fine]
    differ = np.flatnonzero(coarse != other)
    return self._union(coarse, coarse[differ], other[differ])

  def push(self, stages: list, members: np.ndarray, inner: np.ndarray,
           joined: np.ndarray) -> None:
    """Adds each stage's row (`members` `[k, n]` as `Batch`'s, `inner` `[k *
    n]`, `joined`: `self.joined` of it), dropping the oldest beyond
    `size`."""
    if not self.size:
      return
    j, _ = self._point(stages)
    k, n = members.shape
    self.members[stages, j] = members
    self.inner[stages, j] = inner.reshape(k, n)
    self.prefix[stages] = joined.reshape(k, n)
    for s in stages:
      self.pushed[s] += 1
    if j == self.size - 1:
      self._rebuild(stages)

  def _rebuild(self, stages: list) -> None:
    """The suffixes of the block the stages just completed."""
    size, k = self.size, len(stages)
    self.suffix[stages, 0] = self.prefix[stages]
    rows = np.arange(0, k * self.n, self.n)[:, None]
    labels = None
    for i in range(size - 1, 0, -1):
      positions = (self.members[stages, i] + rows).ravel()
      inner = self.inner[stages, i].ravel()
      labels = (self._labels(stages, positions, inner) if labels is None
                else self._join(labels, positions, inner))
      self.suffix[stages, i] = labels.reshape(k, self.n)

  def _point(self, stages: list) -> tuple[int, bool]:
    """`(j, full)`: the rows of the current block the stages pushed, and
    whether a complete block precedes them (the same for all of them)."""
    pushed = self.pushed[stages[0]]
    if any(self.pushed[s] != pushed for s in stages):
      raise ValueError(f"stages {stages} have pushed "
                       f"{[self.pushed[s] for s in stages]} rows; valid: "
                       "stages at the same row")
    if not self.size:
      return 0, False
    return pushed % self.size, pushed >= self.size

  def _labels(self, stages: list, positions: np.ndarray, inner: np.ndarray
              ) -> np.ndarray:
    """`[k * n]` each worker's group in its row, as labels of its stage."""
    k, n = len(stages), self.n
    head = np.empty(k * n, bool)
    head[0] = True
    np.logical_not(inner[:-1], out=head[1:])
    group = np.cumsum(head.reshape(k, n), axis=1)
    group += self.ids[stages, :1] - 1
    labels = np.empty(k * n, np.int64)
    labels[positions] = group.ravel()
    return labels

  def _join(self, labels: np.ndarray, positions: np.ndarray,
            inner: np.ndarray) -> np.ndarray:
    """`labels` (`[k * n]`) joined with the groups of `positions`, `inner`.

    Only members next to each other in a group whose labels differ are
    edges, between labels, so the union-find runs over the few components
    rather than the workers; each label's root is its component's smallest.
    """
    a = labels[positions]
    cross = a[:-1] != a[1:]
    cross &= inner[:-1]
    edges = np.flatnonzero(cross)
    return self._union(labels, a[edges], a[edges + 1])

  def _union(self, labels: np.ndarray, x: np.ndarray, y: np.ndarray
             ) -> np.ndarray:
    """`labels` with `x[i]` and `y[i]` joined, each label becoming its
    component's smallest."""
    if not len(x):
      return labels
    parent, moved = self._parent, []
    for x, y in zip(x.tolist(), y.tolist()):
      while parent[x] != x:
        parent[x] = x = parent[parent[x]]
      while parent[y] != y:
        parent[y] = y = parent[parent[y]]
      if x < y:
        parent[y] = x
        moved.append(y)
      elif y < x:
        parent[x] = y
        moved.append(x)
    if not moved:
      return labels
    roots = []
    for x in moved:
      while parent[x] != x:
        x = parent[x]
      roots.append(x)
    mapping = self.ids.ravel().copy()
    mapping[moved] = roots
    for x in moved:
      parent[x] = x
    return mapping[labels]


def waits(components: np.ndarray, batch: Batch) -> list[list[int]]:
  """Per row, the groups that must wait for their predecessor so that the
  row's sync graph (`components`, `SyncWindow.components` of it) is
  connected.

  In time order, the earliest group that does not share a component with
  the next one waits for it and they merge (seed 002 §3.4: "wait for more
  ready workers and re-generate the group"). Once merged, the groups seen
  so far are one component, so a group merges into its predecessor exactly
  when it is the first of its component.

  Returns:
    Per row, the indices of its groups that merge into the one before,
    increasing; empty when the graph is connected.
  """
  label = components[batch.positions[batch.heads]]  # rows' labels differ
  order = np.arange(len(label))
  first = np.full(label.max() + 1, len(label))
  np.minimum.at(first, label, order)
  firsts = np.flatnonzero(first[label] == order)
  cut = np.searchsorted(firsts, batch.first)
  return [(firsts[cut[r] + 1:cut[r + 1]] - batch.first[r]).tolist()
          for r in range(len(batch.groups))]


def merge(groups: Groups, starts: np.ndarray, waits: list[int]
          ) -> tuple[Groups, np.ndarray]:
  """`groups` with each of `waits` merged into the group before; a merged
  group starts when its last part does.

  Examples:
    >>> g, t = merge(Groups(np.arange(3), np.arange(4)), [0.0, 1.0, 2.0], [1])
    >>> [x.tolist() for x in g], t.tolist()
    ([[0, 1], [2]], [1.0, 2.0])
  """
  kept = np.ones(len(groups), bool)
  kept[waits] = False
  firsts = np.flatnonzero(kept)
  merged = np.maximum.reduceat(np.asarray(starts), firsts)
  offsets = np.append(groups.offsets[:-1][kept], len(groups.members))
  return Groups(groups.members, offsets), merged


HISTORY_UNITS = ("iteration", "group")
GROUPINGS = ("iteration", "arrival")


def check(history: int, window: float, min_size: int,
          history_unit: str, grouping: str = "iteration") -> None:
  """Raises a one-line ValueError for an invalid P, T, `min_size`, unit or
  grouping."""
  if grouping not in GROUPINGS:
    raise ValueError(f"grouping={grouping!r} is invalid; valid: "
                     f"{', '.join(GROUPINGS)}")
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
    self.num_stages = num_stages
    self.window, self.enforce, self.history = window, enforce, history
    self.min_size = min_size  # §4's adaptive timeout (`window_groups`)
    self.history_unit = history_unit
    self.past = None  # SyncWindow of the last P - 1 units of every stage
    self.waiting = {}  # stage -> (begin, end) of its last enforcement wait
    self.groups = [[] for _ in range(num_stages)]  # per stage, per iteration
    self.skipped = []  # (stage, iteration) whose validation was skipped

  def decide(self, stage: int, iteration: int, ready: np.ndarray
             ) -> tuple[Groups, list]:
    """This iteration's groups of `stage` and when each starts averaging."""
    batch = self.decide_many([stage], iteration, np.asarray(ready)[None])
    return batch.groups[0], batch.starts[0].tolist()

  def decide_many(self, stages: list, iteration: int, ready: np.ndarray
                  ) -> Batch:
    """`decide` for each of `stages` in turn (`ready`: `[k, N]`), with the
    grouping and the sync graphs of all of them computed together; only the
    deadlock rule, which looks at the stages decided before, runs one
    stage at a time.

    Returns:
      The groups decided, stacked (`Batch`).
    """
    stages = list(stages)
    if self.past is None:
      self.past = SyncWindow(self.num_stages, self.history - 1,
                             ready.shape[1])
    batch = window_batch(ready, self.window, self.min_size)
    groups, starts = list(batch.groups), list(batch.starts)
    if self.history_unit == "group":
      for r, s in enumerate(stages):
        groups[r], starts[r] = self._by_group(s, iteration, groups[r],
                                              starts[r])
        self.groups[s].append(groups[r])
      return stacked(groups, starts, batch.members)
    joined = self.past.joined(stages, batch.positions, batch.inner)
    late = (waits(self.past.components(stages, joined), batch)
            if self.enforce else [[]] * len(stages))
    merged = []
    for r, stage in enumerate(stages):
      if late[r]:
        begin = starts[r][late[r][0] - 1]  # the earliest group that waits
        if self._blocked(stage, begin):
          self.skipped.append((stage, iteration))
        else:
          groups[r], starts[r] = merge(groups[r], starts[r], late[r])
          self.waiting[stage] = (begin, starts[r].max())
          merged.append(r)
      self.groups[stage].append(groups[r])
    if merged:
      batch, n = stacked(groups, starts, batch.members), ready.shape[1]
      joined = joined.copy()
      for r in merged:
        joined[r * n:r * n + n] = self.past.joined(
            [stages[r]], groups[r].members, groups[r].inner)
    self.past.push(stages, batch.members, batch.inner, joined)
    return batch

  def _blocked(self, stage: int, begin: float) -> bool:
    """Whether another stage's enforcement is still waiting at `begin`."""
    return any(s != stage and b <= begin < e
               for s, (b, e) in self.waiting.items())

  def _by_group(self, stage, iteration, groups, starts):
    """This iteration's groups validated one by one (`history_unit`)."""
    graph, n = self.past, len(groups.members)
    waits_, checking, begin = [], self.enforce, None
    first = 0  # the candidate: groups first..j
    for j in range(len(groups)):
      lo, hi = groups.offsets[first], groups.offsets[j + 1]
      alone = np.setdiff1d(np.arange(n), groups.members[lo:hi])
      members = np.concatenate([groups.members[lo:hi], alone])
      inner = np.zeros(n, bool)
      inner[:hi - lo - 1] = True
      joined = graph.joined([stage], members, inner)
      if checking and j + 1 < len(groups):
        labels = graph.components([stage], joined)
        if (labels != labels[0]).any():
          if begin is None and self._blocked(stage, starts[j]):
            self.skipped.append((stage, iteration))
            checking = False
          else:
            begin = starts[j] if begin is None else begin
            waits_.append(j + 1)  # waits for the next group and merges
            continue
      graph.push([stage], members[None], inner, joined)
      first = j + 1
    if not waits_:
      return groups, starts
    groups, starts = merge(groups, starts, waits_)
    self.waiting[stage] = (begin, starts.max())
    return groups, starts


class Arrival(NamedTuple):
  """A group the arrival scheduler sent, its members in arrival order."""

  members: np.ndarray  # [k] int, workers
  iterations: np.ndarray  # [k] int, the iteration after which each signalled
  ready: np.ndarray  # [k] float, when each signalled
  close: float  # when the group is sent: its averaging starts

  @property
  def iteration(self) -> int:
    """The group's iteration: the newest its members signalled after."""
    return int(self.iterations.max())


class ArrivalScheduler:
  """SDPipe's scheduler over ready signals as they arrive, across iterations.

  Seed 002 Algorithm 1: a worker signals after each iteration's update and
  waits for its group before its next iteration. Algorithm 2: per stage, a
  group opens at the earliest waiting signal and takes every signal until T
  after it, whatever iteration each worker is at, so that a fast worker's
  signal after iteration k + 1 can meet a slow worker's after k; it closes
  early once it holds every worker still expected to signal (those with
  iterations left). With `min_size` > 1, §4's adaptive timeout: a group that
  closes with fewer workers waits until that many joined.

  Validation (§3.3-3.4), group by group in time order: the sync graph of the
  stage's recent groups plus the candidate must connect the workers, or the
  candidate waits for the next group (the window of T opened by the next
  signal) and merges with it, until it does. What "recent" is, `P` counted
  as `history_unit` says:

  - "group": the last P - 1 groups of the stage (§3.2's clock k counts
    group-sync operations);
  - "iteration": the stage's groups formed before whose iteration (the
    newest any member signalled after) lies within P - 1 of the
    candidate's. A group of mixed iterations belongs to its newest.

  A group holding every worker still expected has no later signal to wait
  for and is sent as it is. Deadlock prevention (§3.4): a wait (for the next
  group, or §4's for `min_size`) may not begin while another stage's is
  waiting; the group is then sent as it is and `(stage, iteration)` is
  recorded in `skipped`.

  The scheduler is driven by its caller's clock: `signal` hands it a worker's
  ready signal as soon as the caller knows it, `next` names the earliest
  decision its signals fix, and `decide` takes it. A decision at time t is
  final once every signal at or before t is in; it is in when the caller
  knows no signal can come earlier than `next`'s time (the simulator: every
  worker has run until it waits for a group, and a worker resumed by a
  decision signals after it).

  Examples:
    >>> sched = ArrivalScheduler(1, num_workers=2, num_iterations=2,
    ...                          history=1, window=0.1)
    >>> sched.signal(0, worker=0, iteration=0, time=0.0)
    >>> sched.signal(0, worker=1, iteration=0, time=0.5)
    >>> sched.next()  # the first window closes at T, with worker 0 alone
    (0.1, 0)
    >>> sched.decide(0) is None  # P = 1: alone it disconnects; it waits
    True
    >>> g = sched.decide(*sched.next()[1:])  # merged with worker 1's window
    >>> g.members.tolist(), g.close
    ([0, 1], 0.5)
  """

  def __init__(self, num_stages: int, num_workers: int, num_iterations: int,
               history: int, window: float, enforce: bool = True,
               min_size: int = 1, history_unit: str = "iteration"):
    check(history, window, min_size, history_unit, "arrival")
    S = num_stages
    self.n, self.num_iterations = num_workers, num_iterations
    self.history, self.window, self.enforce = history, window, enforce
    self.min_size, self.history_unit = min_size, history_unit
    self.queue = [[] for _ in range(S)]  # sorted (time, worker, iteration)
    #   of the signals not held
    self.held = [[] for _ in range(S)]  # the candidate waiting, as `queue`'s
    self.since = [None] * S  # when its wait began; None: no wait
    self.growing = [False] * S  # whether it waits for `min_size`
    self.expected = [num_workers] * S  # workers with signals left
    self.next_iteration = np.zeros((S, num_workers), np.int64)
    self.due = [math.inf] * S  # each stage's next decision
    self.recent = [collections.deque(maxlen=max(history - 1, 0))
                   if history_unit == "group" else {} for _ in range(S)]
    #   the groups validation looks back on: members lists (by label for
    #   "iteration")
    self.groups = [[] for _ in range(S)]  # per stage, `Arrival`s in order
    self.skipped = []  # (stage, iteration) whose wait was refused (§3.4)

  def signal(self, stage: int, worker: int, iteration: int,
             time: float) -> None:
    """Worker `worker` of `stage` is ready after iteration `iteration`."""
    bisect.insort(self.queue[stage], (time, worker, iteration))
    self.due[stage] = self._due(stage)

  def next(self) -> tuple[float, int] | None:
    """`(time, stage)` of the earliest decision (the lowest stage first), or
    None while no stage's signals fix one."""
    time = min(self.due)
    return None if time == math.inf else (time, self.due.index(time))

  def decide(self, stage: int) -> Arrival | None:
    """The stage's decision at its due time: the group sent, or None when
    the candidate waits."""
    now, queue, held = self.due[stage], self.queue[stage], self.held[stage]
    cut = bisect.bisect_right(queue, (now, math.inf))
    candidate = held + queue[:cut]
    del queue[:cut]
    members = [w for _, w, _ in candidate]
    label = max(k for _, _, k in candidate)
    everyone = len(candidate) == self.expected[stage]
    too_few = not everyone and len(candidate) < self.min_size
    if too_few or (not everyone and self.enforce
                   and not self._connected(stage, members, label)):
      if self.since[stage] is not None or not any(
          t is not None for s, t in enumerate(self.since) if s != stage):
        self.held[stage] = candidate
        if self.since[stage] is None:
          self.since[stage] = now
        self.growing[stage] = too_few
        self.due[stage] = self._due(stage)
        return None
      self.skipped.append((stage, label))
    group = Arrival(np.array(members),
                    np.array([k for _, _, k in candidate]),
                    np.array([t for t, _, _ in candidate]), now)
    self.held[stage], self.since[stage] = [], None
    self.growing[stage] = False
    self.next_iteration[stage, group.members] = group.iterations + 1
    self.expected[stage] -= int(
        (group.iterations == self.num_iterations - 1).sum())
    self._remember(stage, members, label)
    self.groups[stage].append(group)
    self.due[stage] = self._due(stage)
    return group

  def _due(self, stage: int) -> float:
    """When the stage decides next, from the signals it has."""
    queue, held = self.queue[stage], self.held[stage]
    if not queue:
      return math.inf
    if self.growing[stage]:  # until the min_size-th joins
      need = self.min_size - len(held)
      close = queue[need - 1][0] if len(queue) >= need else math.inf
    else:  # the window opened by the first signal not held
      close = queue[0][0] + self.window
    if len(held) + len(queue) == self.expected[stage]:
      return min(close, queue[-1][0])  # every worker expected is in
    return close

  def _connected(self, stage: int, members: list, label: int) -> bool:
    """Whether the recent groups plus `members` connect the workers."""
    if self.history_unit == "group":
      recent = list(self.recent[stage])
    else:
      by_label = self.recent[stage]
      recent = [g for k in range(label - self.history + 1, label + 1)
                for g in by_label.get(k, ())]
    parent = list(range(self.n))
    components = self.n
    for group in recent + [members]:
      root = _root(parent, group[0])
      for w in group[1:]:
        other = _root(parent, w)
        if other != root:
          parent[other] = root
          components -= 1
    return components == 1

  def _remember(self, stage: int, members: list, label: int) -> None:
    """Adds a group sent to what validation looks back on."""
    if self.history_unit == "group":
      if self.history > 1:
        self.recent[stage].append(members)
      return
    by_label = self.recent[stage]
    by_label.setdefault(label, []).append(members)
    # A later candidate's label is at least the oldest iteration a worker
    # still expected will signal after.
    left = self.next_iteration[stage]
    left = left[left < self.num_iterations]
    oldest = int(left.min()) - self.history + 1 if len(left) else label + 1
    for k in [k for k in by_label if k < oldest]:
      del by_label[k]


def _root(parent: list, x: int) -> int:
  while parent[x] != x:
    parent[x] = x = parent[parent[x]]
  return x


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
