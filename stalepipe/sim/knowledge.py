r"""Which replicas' updates each replica's weights reflect (observed staleness).

For one stage, `know[i, j]` counts the updates of replica `j` that replica
`i`'s copy reflects. After iteration `p` every replica reflects its own
`p + 1` updates, and a group that averages its models (SDPipe eq. 1, an
AD-PSGD pair, an all-reduce) leaves each member with the elementwise maximum
of the members' rows. A backward that read version `v` reflects

.. math:: r_i = \sum_j \max(\text{know}_v[i, j], f_i)

updates, with :math:`f_i` the updates of every replica that the policy
guarantees (WSP's global waves, `Runner.floor`).

The matrix is `N x N`, but most policies keep it *uniform*: every
off-diagonal entry equal to one count `q` (no group yet: `q = 0`; after a
group of everyone, BSP or local SGD: `q = p + 1`), so that
:math:`r_i = \max(v, f_i) + (N - 1)\max(q, f_i)` costs `O(N)`. Only groups
that leave some replicas out (SDPipe, AD-PSGD) make it dense.

References:
  Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023, §3.3
  (the sync graph); Park et al, HetPipe <https://arxiv.org/abs/2005.14038>,
  2020, §5 (global staleness)
"""

import numpy as np

_CHUNK = 256  # iterations whose merges `Knowledge.observe` plans at once


class Knowledge:
  """`know` of every stage: its current value and the versions still read.

  Every stage moves to the next version together (`update` takes each
  stage's groups of one iteration; `observe`, those of a whole run). The
  groups of every stage merge together, one gather per width over the
  `[S * N, N]` rows (at 256 replicas 1.7x faster than stage by stage, at
  1,024 the same); `[pairs, 2]` arrays (AD-PSGD), one width already, merge
  stage by stage, which is faster for them at 1,024.

  Args:
    num_stages: S.
    num_replicas: N.
    num_versions: versions the run reaches (B + 1); the dense matrices are
      int16 when they fit, int32 otherwise.
    depth: how many versions back a read may reach.
    kept: `[S, num_versions]` whether a later read needs that version after a
      newer one is in place (an asynchronous schedule's backward); only
      those are copied aside, for `depth` versions.

  Examples:
    >>> k = Knowledge(num_stages=1, num_replicas=3, num_versions=3)
    >>> k.update(0, [[np.array([0, 1])]])  # iteration 0: replicas 0, 1 average
    >>> k.reflected(0, 1, np.zeros(3, int)).tolist()
    [2, 2, 1]
    >>> k.update(1, [[np.arange(3)]])      # iteration 1: everyone
    >>> k.reflected(0, 2, np.zeros(3, int)).tolist()
    [6, 6, 6]
  """

  def __init__(self, num_stages: int, num_replicas: int, num_versions: int,
               depth: int = 1, kept: np.ndarray | None = None):
    self.n, self.depth = num_replicas, depth
    self.dtype = np.int16 if num_versions <= np.iinfo(np.int16).max else (
        np.int32)
    # Row sums are at most N * num_versions: int32 sums run twice as fast.
    self.sum_dtype = (np.int32 if num_replicas * num_versions
                      <= np.iinfo(np.int32).max else np.int64)
    self.kept = (np.zeros((num_stages, num_versions), bool) if kept is None
                 else kept)
    self.version = 0  # the version the current values belong to
    self.common = [0] * num_stages  # each stage's off-diagonal count, uniform
    self.is_dense = [False] * num_stages  # once a group left some out
    self.dense = None  # [S, N, N] where `is_dense`, allocated on first use
    self.sums = None  # [S, N] the dense matrices' row sums
    self.saved = {}  # (stage, version) -> common count, or a matrix copy

  def update(self, iteration: int, groups: list) -> None:
    """Every replica adds its own update, then each stage's groups average.

    The groups of every stage that leaves some replicas out merge together,
    as rows of the `[S * N, N]` matrix (a handful of gathers per iteration
    rather than per stage).

    Args:
      iteration: p, the current version; afterwards it is `p + 1` and every
        diagonal entry is `p + 1`.
      groups: per stage, disjoint index arrays, a `[groups, size]` array or
        `grouping.Groups`.
    """
    self._step(iteration, groups, _plans([groups], self.n)[0])

  def observe(self, groups: list, read: np.ndarray, floor: np.ndarray
              ) -> np.ndarray:
    """Every iteration in turn from the current one: what each stage's
    backward read (`reflected`), then the iteration's groups (`update`).

    The merges of `_CHUNK` iterations are planned at once (`_plans`), so
    that an iteration costs its gathers alone.

    Args:
      groups: `[B]` per iteration, per stage groups (as `update` takes).
      read: `[S, B]` the version each stage's backward of each minibatch
        read.
      floor: `[S, B, N]` the floors `reflected` takes; overwritten.

    Returns:
      `floor`, holding `[S, B, N]` the updates each backward's weights
      reflect.
    """
    first = self.version
    for lo in range(0, len(groups), _CHUNK):
      chunk = groups[lo:lo + _CHUNK]
      for q, plan in enumerate(_plans(chunk, self.n)):
        p = first + lo + q
        for s in range(len(read)):
          floor[s, p] = self.reflected(s, read[s, p], floor[s, p])
        self._step(p, chunk[q], plan)
    return floor

  def _step(self, iteration: int, groups: list, plan: tuple) -> None:
    """`update`, with the merges of groups other than `[pairs, 2]` arrays
    planned (`_plans`)."""
    n, old = self.n, self.version
    own = self.version = iteration + 1
    merges, blocks = plan
    bumped, dense, pairs = [], [], []  # stages whose diagonal moves to `own`
    for s, found in enumerate(groups):
      if self.kept[s, old]:
        self.saved[s, old] = (self.dense[s].copy() if self.is_dense[s]
                              else self.common[s])
      self.saved.pop((s, own - self.depth), None)
      if len(found) == 1 and len(found[0]) == n:  # all average
        self.common[s], self.is_dense[s] = own, False
        continue
      if isinstance(found, np.ndarray):  # [groups, width]: one width
        some = found.ndim == 2 and found.size > 0 and found.shape[1] > 1
        if some:  # merged on their own: no padding to work out
          pairs.append((s, found.T))
      else:
        some = merges[s]
      if self.is_dense[s]:
        bumped.append(s)  # its row sums, from p to p + 1
      elif not some:
        continue
      else:
        if self.dense is None:
          self.dense = np.empty((len(groups), n, n), self.dtype)
          self.sums = np.empty((len(groups), n), self.sum_dtype)
        self.dense[s] = self.common[s]
        self.sums[s] = (n - 1) * self.common[s] + own
        self.is_dense[s] = True
      dense.append(s)
    if len(bumped) == len(groups):
      self.sums += 1
    else:
      for s in bumped:
        self.sums[s] += 1
    if len(dense) == len(groups):
      self.dense.reshape(len(groups), -1)[:, ::n + 1] = own
    else:
      for s in dense:
        self.dense[s].flat[::n + 1] = own
    for s, rows in pairs:
      _merge(self.dense[s], self.sums[s], rows)
    if blocks:
      rows, sums = self.dense.reshape(-1, n), self.sums.reshape(-1)
      for block in blocks:
        _merge(rows, sums, block)

  def reflected(self, stage: int, version: int, floor: np.ndarray
                ) -> np.ndarray:
    """`[N]` updates reflected by `stage`'s weights of `version` under
    `floor` `[N]`."""
    if version == self.version:
      if self.is_dense[stage] and not floor.any():
        return self.sums[stage].copy()
      read = self.dense[stage] if self.is_dense[stage] else (
          self.common[stage])
    else:
      read = self.saved[stage, version]
    if np.isscalar(read):
      if not floor.any():
        return np.full(self.n, version + (self.n - 1) * read, np.int64)
      return (np.maximum(version, floor)
              + (self.n - 1) * np.maximum(read, floor)).astype(np.int64)
    if floor.any():
      read = np.maximum(read, floor[:, None])
    return read.sum(axis=1, dtype=self.sum_dtype)


def _plans(chunk: list, n: int) -> list[tuple[list, list]]:
  """Per iteration of `chunk` (each: per stage groups, as `update` takes),
  `(merges, blocks)`: whether each stage has groups of two or more to merge
  through `blocks` (not all-average, not a `[pairs, 2]` array), and those
  groups of every stage as `rows [width, groups]` of the `[S * N, N]`
  matrix, one block per width.

  Groups of sizes in `(w/2, w]` are padded to `w` rows by repeating their
  last member (at most twice the rows, one gather per width). The whole
  chunk's groups are sorted into blocks at once.
  """
  S = len(chunk[0])
  members, offsets, owner = [], [], []  # owner: q * S + s of each entry
  for q, groups in enumerate(chunk):
    for s, found in enumerate(groups):
      if (isinstance(found, np.ndarray) or not len(found)
          or (len(found) == 1 and len(found[0]) == n)):
        continue
      if hasattr(found, "offsets"):  # grouping.Groups
        members.append(found.members)
        offsets.append(found.offsets)
      else:
        members.append(np.concatenate(found))
        offsets.append(np.cumsum([0] + [len(g) for g in found]))
      owner.append(q * S + s)
  merges = np.zeros((len(chunk), S), bool)
  blocks = [[] for _ in chunk]
  if not owner:
    return list(zip(merges.tolist(), blocks))
  step = np.diff(np.concatenate(offsets))  # < 0 between two entries
  real = step > 0
  size, entry = step[real], np.cumsum(~real)[real]  # each group's
  owner = np.asarray(owner)
  rows = np.concatenate(members) + np.repeat(owner % S * n, [
      len(m) for m in members])
  multi = size > 1
  rows, size, entry = rows[np.repeat(multi, size)], size[multi], entry[multi]
  merges.ravel()[owner[entry]] = True
  at = owner[entry] // S  # each group's iteration
  heads = np.cumsum(size) - size
  log = np.frexp(size - 1)[1]  # ceil(log2(size))
  for c in np.flatnonzero(np.bincount(log)).tolist():
    mine = np.flatnonzero(log == c)
    pad = np.minimum(np.arange(1 << c)[:, None], size[mine] - 1)
    block = rows[heads[mine] + pad]
    cut = np.searchsorted(at[mine], np.arange(len(chunk) + 1)).tolist()
    for q in np.flatnonzero(np.diff(cut)).tolist():
      blocks[q].append(block[:, cut[q]:cut[q + 1]])
  return list(zip(merges.tolist(), blocks))


def _merge(know: np.ndarray, sums: np.ndarray, rows: np.ndarray) -> None:
  """The rows of each group (`rows[:, g]`) become their maximum; `sums`
  `[N]`, the row sums, follow.

  One gather of `[width, groups, N]`, folded in halves (NumPy's row-wise
  `maximum.reduceat`, or a maximum over the middle axis, is several times
  slower).
  """
  block = np.take(know, rows, axis=0)
  while len(block) > 1:
    half = len(block) // 2
    block = np.maximum(block[:half], block[half:], out=block[:half])
  know[rows] = block[0]
  sums[rows] = block[0].sum(axis=1, dtype=sums.dtype)


def by_arrival(groups: list, read: np.ndarray, num_replicas: int
               ) -> np.ndarray:
  """Updates reflected under groups that hold workers at different
  iterations (SDPipe's grouping by arrival, seed 002 Algorithm 2).

  Each worker has its own row `know[i]`: after its own update of iteration
  k its entry `i` is `k + 1`, and a group leaves every member with the
  elementwise maximum of the members' rows as they signalled. So a worker
  after a group reflects the other members' updates up to each one's own
  iteration: after a group with a worker one iteration ahead, one update of
  it more than of itself. Its version `k + 1` (the weights after that
  group) is that row; version 0 reflects nothing.

  Args:
    groups: per stage, its groups in time order, each with `members` and
      `iterations` (`grouping.Arrival`).
    read: `[S, B]` the version each stage's backward of each minibatch read.
    num_replicas: N.

  Returns:
    `[S, B, N]` the updates each backward's weights reflect.

  Examples:
    >>> from stalepipe.sync import grouping
    >>> g = lambda m, k: grouping.Arrival(np.array(m), np.array(k), None, 0.0)
    >>> groups = [[g([0], [0]), g([1, 0], [0, 1])]]  # 0 at 1 meets 1 at 0
    >>> by_arrival(groups, np.array([[0, 1]]), 2)[0].tolist()
    [[0, 0], [1, 3]]
  """
  S, B = read.shape
  n = num_replicas
  out = np.zeros((S, B, n), np.int64)
  for s in range(S):
    readers = np.argsort(read[s], kind="stable")
    bounds = np.searchsorted(read[s][readers], np.arange(B + 2))
    know = np.zeros((n, n), np.int64)
    for group in groups[s]:
      members, iterations = group.members, group.iterations
      rows = know[members]
      rows[np.arange(len(members)), members] = iterations + 1
      know[members] = merged = rows.max(axis=0)
      total = merged.sum()
      for m, v in zip(members.tolist(), (iterations + 1).tolist()):
        out[s, readers[bounds[v]:bounds[v + 1]], m] = total
  return out
