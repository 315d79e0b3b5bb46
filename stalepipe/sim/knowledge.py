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


class Knowledge:
  """`know` of every stage: its current value and the versions still read.

  Every stage moves to the next version together (`update` takes each
  stage's groups of one iteration). The groups of every stage merge together,
  one gather per width over the `[S * N, N]` rows (at 256 replicas 1.7x
  faster than stage by stage, at 1,024 the same); `[pairs, 2]` arrays
  (AD-PSGD), one width already, merge stage by stage, which is faster for
  them at 1,024.

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
    n, old = self.n, self.version
    own = self.version = iteration + 1
    merging = []  # (members, heads, sizes) of each stage's groups of 2+
    for s, found in enumerate(groups):
      if self.kept[s, old]:
        self.saved[s, old] = (self.dense[s].copy() if self.is_dense[s]
                              else self.common[s])
      self.saved.pop((s, own - self.depth), None)
      if len(found) == 1 and len(found[0]) == n:  # all average
        self.common[s], self.is_dense[s] = own, False
        continue
      pairs = isinstance(found, np.ndarray)  # [groups, width]: one width
      if pairs:
        some = found.ndim == 2 and found.size > 0 and found.shape[1] > 1
      else:
        members, heads, sizes = _multi(found)
        some = len(sizes) > 0
      if self.is_dense[s]:
        self.sums[s] += 1  # the diagonal, from p to p + 1
      elif not some:
        continue
      else:
        if self.dense is None:
          self.dense = np.empty((len(groups), n, n), self.dtype)
          self.sums = np.empty((len(groups), n), self.sum_dtype)
        self.dense[s] = self.common[s]
        self.sums[s] = (n - 1) * self.common[s] + own
        self.is_dense[s] = True
      self.dense[s].flat[::n + 1] = own
      if pairs:  # merged on their own: no padding to work out
        if some:
          _merge(self.dense[s], self.sums[s], found.T)
      else:
        merging.append((members + s * n, heads, sizes))
    if not merging:
      return
    starts = np.cumsum([0] + [len(m) for m, _, _ in merging[:-1]])
    members = np.concatenate([m for m, _, _ in merging])
    heads = np.concatenate([h + a for (_, h, _), a in zip(merging, starts)])
    sizes = np.concatenate([z for _, _, z in merging])
    rows, sums = self.dense.reshape(-1, n), self.sums.reshape(-1)
    for rows_of_width in _blocks(members, heads, sizes):
      _merge(rows, sums, rows_of_width)

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


def _multi(groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(members, heads, sizes)` of the groups of two or more, their members
  one group after another (`heads` index `members`).

  Takes `grouping.Groups` or index arrays.
  """
  if hasattr(groups, "offsets"):  # grouping.Groups
    members, heads, sizes = groups.members, groups.offsets[:-1], groups.sizes
  else:
    sizes = np.array([len(g) for g in groups], np.int64)
    members = (np.concatenate(groups) if len(groups)
               else np.zeros(0, np.int64))
    heads = np.cumsum(sizes) - sizes
  multi = sizes > 1
  return members, heads[multi], sizes[multi]


def _blocks(members: np.ndarray, heads: np.ndarray, sizes: np.ndarray
            ) -> list[np.ndarray]:
  """The groups (`members[heads[g]:heads[g] + sizes[g]]`, sizes >= 2) as
  `rows [width, groups]` blocks, one per width.

  Groups of sizes in `(w/2, w]` are padded to `w` rows by repeating their
  last member (at most twice the rows, one gather per width).
  """
  if not len(sizes):
    return []
  log = np.ceil(np.log2(sizes)).astype(np.int64)
  out = []
  for c in np.flatnonzero(np.bincount(log)).tolist():
    mine = log == c
    pad = np.minimum(np.arange(1 << c)[:, None], sizes[mine] - 1)
    out.append(members[heads[mine] + pad])
  return out


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
