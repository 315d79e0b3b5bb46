"""SDPipe's scheduler as it was first written: union-find, group lists.

The oracle the vectorised `stalepipe.sync.grouping` is tested against,
decision for decision (seed 002 §3.2-3.4), with Algorithm 2 as an event loop
over the signals (`algorithm2`, §4's adaptive timeout included) and P counted
in group-sync operations (`GroupClockScheduler`); and Algorithms 1-2 across
iterations, groups formed by arrival, as a plain event loop (`arrival_loop`).
"""

import collections
import heapq

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


def arrival_loop(num_stages, num_workers, num_iterations, history, window,
                 next_signal, min_size=1, history_unit="iteration",
                 enforce=True, averaging=lambda stage, size: 0.0):
  """Seed 002 Algorithms 1-2 across iterations, as a plain event loop.

  Every worker signals after each iteration's update and waits for its
  group (Algorithm 1); `next_signal(stage, worker, iteration, resumed)` is
  when it signals after `iteration`, given when its last group's averaging
  ended (0 before the first; a group of k averages `averaging(stage, k)`
  seconds). Time moves to the next signal or window end;
  at each instant the signals arrive first, then each stage, lowest first,
  takes its decision if one is due: its window ended, every worker still
  expected has joined, or a group waiting to grow reached `min_size`. A
  signal opens a window of `window` when none is open. A candidate with too
  few workers, or whose sync graph is disconnected (union-find over the
  last P - 1 groups, or over the groups of iterations within P - 1 of its
  own, the newest any member is at), waits: for more signals until it has
  `min_size`, otherwise for the window the next signal opens, and merges
  with it. A wait may not begin while another stage's is waiting: the
  candidate is then sent as it is and (stage, iteration) recorded.

  Returns:
    `(groups, skipped)`: per stage, `(members, iterations, close)` of each
    group in time order; the skips.
  """
  signals = []
  for s in range(num_stages):
    for w in range(num_workers):
      heapq.heappush(signals, (next_signal(s, w, 0, 0.0), s, w, 0))
  state = [{"members": [], "end": None, "since": None, "growing": False}
           for _ in range(num_stages)]
  expected = [num_workers] * num_stages
  sent = [[] for _ in range(num_stages)]  # (members, iterations, close)
  skipped = []

  def connected(s, members, label):
    if history_unit == "group":
      recent = [g[0] for g in sent[s][max(len(sent[s]) - history + 1, 0):]
                ] if history > 1 else []
    else:
      recent = [g[0] for g in sent[s]
                if label - history + 1 <= max(g[1]) <= label]
    return sync_graph(num_workers, recent + [members]).components == 1

  def decide(s, now):
    st = state[s]
    candidate = st["members"]
    members = [w for _, w, _ in candidate]
    iterations = [k for _, _, k in candidate]
    everyone = len(candidate) == expected[s]
    too_few = not everyone and len(candidate) < min_size
    if too_few or (enforce and not everyone
                   and not connected(s, members, max(iterations))):
      others = [t for r, t in enumerate(state) if r != s
                and t["since"] is not None]
      if st["since"] is not None or not others:
        if st["since"] is None:
          st["since"] = now
        st["growing"], st["end"] = too_few, None
        return
      skipped.append((s, max(iterations)))
    sent[s].append((members, iterations, now))
    state[s] = {"members": [], "end": None, "since": None, "growing": False}
    resumed = now + averaging(s, len(members))
    for w, k in zip(members, iterations):
      if k + 1 < num_iterations:
        heapq.heappush(signals, (next_signal(s, w, k + 1, resumed), s, w,
                                 k + 1))
      else:
        expected[s] -= 1

  while True:
    ends = [st["end"] for st in state if st["end"] is not None]
    times = ends + ([signals[0][0]] if signals else [])
    if not times:
      break
    now = min(times)
    while signals and signals[0][0] <= now:
      t, s, w, k = heapq.heappop(signals)
      st = state[s]
      st["members"].append((t, w, k))
      if st["end"] is None and not st["growing"]:
        st["end"] = t + window
    for s, st in enumerate(state):
      if st["members"] and (
          len(st["members"]) == expected[s]
          or (st["end"] is not None and st["end"] <= now)
          or (st["growing"] and len(st["members"]) >= min_size)):
        decide(s, now)
  return sent, skipped
