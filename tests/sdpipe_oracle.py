"""SDPipe's scheduler as it was first written: union-find, group lists.

The oracle the vectorised `stalepipe.sync.grouping` is tested against,
decision for decision (seed 002 §3.2-3.4), with Algorithm 2 as an event loop
over the signals (`algorithm2`, §4's adaptive timeout included) and P counted
in group-sync operations (`GroupClockScheduler`).
"""

import collections

import numpy as np


class UnionFind:

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
  uf = UnionFind(num_workers) if uf is None else uf.copy()
  for g in groups:
    members = g.tolist() if isinstance(g, np.ndarray) else list(g)
    for w in members[1:]:
      uf.union(members[0], w)
  return uf


def window_groups(ready: np.ndarray, window: float
                  ) -> tuple[list[np.ndarray], list[float]]:
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


def algorithm2(ready, window, min_size=1):
  """Seed 002 Algorithm 2 as an event loop over the signals in arrival
  order: a group opens at the first waiting signal and takes every signal
  until `window` after it; while it holds fewer than `min_size`, its timeout
  grows to the next signal, one at a time (§4); it closes as soon as every
  worker expected has joined."""
  order = sorted(range(len(ready)), key=lambda i: (ready[i], i))
  groups, starts, k = [], [], 0
  while k < len(order):
    deadline, members = ready[order[k]] + window, []
    while k < len(order) and (ready[order[k]] <= deadline
                              or len(members) < min_size):
      if ready[order[k]] > deadline:
        deadline = ready[order[k]]
      members.append(order[k])
      k += 1
    groups.append(members)
    starts.append(float(ready[members[-1]]) if k == len(order)
                  else float(deadline))
  return groups, starts


class GroupClockScheduler:
  """Seed 002 §3.2-3.4 with P counted in group-sync operations.

  Each group of an iteration (`algorithm2`'s), in time order, is checked
  with union-find against the last P - 1 groups formed at its stage and
  waits for the next group while the graph is disconnected; an iteration's
  last group is kept; a wait that would begin while another stage's
  enforcement is waiting skips the rest of the iteration's validations.
  """

  def __init__(self, num_stages: int, history: int, window: float,
               min_size: int = 1):
    self.window, self.min_size = window, min_size
    self.recent = [collections.deque(maxlen=history - 1)
                   for _ in range(num_stages)]
    self.waiting = {}
    self.skipped = []

  def decide(self, stage: int, iteration: int, ready: np.ndarray):
    found, starts = algorithm2(ready, self.window, self.min_size)
    out, out_starts, candidate = [], [], []
    checking, begin = True, None
    for j, (group, start) in enumerate(zip(found, starts)):
      candidate = candidate + group
      if checking and j + 1 < len(found) and sync_graph(
          len(ready), list(self.recent[stage]) + [candidate]).components > 1:
        if begin is None and any(s != stage and b <= start < e
                                 for s, (b, e) in self.waiting.items()):
          self.skipped.append((stage, iteration))
          checking = False
        else:
          begin = start if begin is None else begin
          continue
      self.recent[stage].append(candidate)
      out.append(candidate)
      out_starts.append(start)
      candidate = []
    if begin is not None:
      self.waiting[stage] = (begin, max(out_starts))
    return out, out_starts
