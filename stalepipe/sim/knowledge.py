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

_FOLD = 4  # groups up to this size are merged column by column


class Knowledge:
  """`know` of one stage: its current value and the versions still read.

  Args:
    num_replicas: N.
    num_versions: versions the run reaches (B + 1); the dense matrix is
      int16 when they fit, int32 otherwise.
    depth: how many versions back a read may reach.
    kept: `[num_versions]` whether a later read needs that version after a
      newer one is in place (an asynchronous schedule's backward); only
      those are copied aside, for `depth` versions.

  Examples:
    >>> k = Knowledge(num_replicas=3, num_versions=3)
    >>> k.update(0, [np.array([0, 1])])   # iteration 0: replicas 0, 1 average
    >>> k.reflected(1, np.zeros(3, int)).tolist()
    [2, 2, 1]
    >>> k.update(1, [np.arange(3)])       # iteration 1: everyone
    >>> k.reflected(2, np.zeros(3, int)).tolist()
    [6, 6, 6]
  """

  def __init__(self, num_replicas: int, num_versions: int, depth: int = 1,
               kept: np.ndarray | None = None):
    self.n, self.depth = num_replicas, depth
    self.dtype = np.int16 if num_versions <= np.iinfo(np.int16).max else (
        np.int32)
    # Row sums are at most N * num_versions: int32 sums run twice as fast.
    self.sum_dtype = (np.int32 if num_replicas * num_versions
                      <= np.iinfo(np.int32).max else np.int64)
    self.kept = np.zeros(num_versions, bool) if kept is None else kept
    self.version = 0  # the version the current value belongs to
    self.common = 0  # the off-diagonal count while uniform
    self.dense = None  # [N, N] once a group has left some replicas out
    self.sums = None  # [N] the dense matrix's row sums
    self.saved = {}  # version -> common count, or a copy of the matrix

  def update(self, iteration: int, groups) -> None:
    """Every replica adds its own update, then `groups` average.

    Args:
      iteration: p, the current version; afterwards it is `p + 1` and every
        diagonal entry is `p + 1`.
      groups: disjoint index arrays, a `[groups, size]` array or
        `grouping.Groups`.
    """
    if self.kept[self.version]:
      self.saved[self.version] = (self.common if self.dense is None
                                  else self.dense.copy())
    own = self.version = iteration + 1
    self.saved.pop(own - self.depth, None)
    if len(groups) == 1 and len(groups[0]) == self.n:  # all average
      self.common, self.dense = own, None
      return
    if hasattr(groups, "offsets"):  # grouping.Groups: merged in one pass
      runs, blocks = _runs(groups), []
    else:
      runs, blocks = None, _blocks(groups)
    if self.dense is not None:
      self.sums += 1  # the diagonal, from p to p + 1
    elif runs or blocks:
      self.dense = np.full((self.n, self.n), self.common, self.dtype)
      self.sums = np.full(self.n, (self.n - 1) * self.common + own,
                          self.sum_dtype)
    else:
      return
    self.dense.flat[::self.n + 1] = own
    if runs:
      _merge_runs(self.dense, self.sums, *runs)
    for block in blocks:
      _merge(self.dense, self.sums, block)

  def reflected(self, version: int, floor: np.ndarray) -> np.ndarray:
    """`[N]` updates reflected by weights of `version` under `floor` `[N]`."""
    if version == self.version:
      if self.dense is not None and not floor.any():
        return self.sums.copy()
      read = self.common if self.dense is None else self.dense
    else:
      read = self.saved[version]
    if np.isscalar(read):
      if not floor.any():
        return np.full(self.n, version + (self.n - 1) * read, np.int64)
      return (np.maximum(version, floor)
              + (self.n - 1) * np.maximum(read, floor)).astype(np.int64)
    if floor.any():
      read = np.maximum(read, floor[:, None])
    return read.sum(axis=1, dtype=self.sum_dtype)


def _runs(groups) -> tuple | None:
  """`(members, heads, sizes)` of a `grouping.Groups`' groups of two or
  more: their members group after group, where each group begins and its
  size; None when there are none."""
  sizes = groups.sizes
  multi = sizes > 1
  if not multi.any():
    return None
  if multi.all():
    return groups.members, groups.offsets[:-1], sizes
  kept = sizes[multi]
  heads = np.zeros(len(kept), np.int64)
  np.cumsum(kept[:-1], out=heads[1:])
  return groups.members[np.repeat(multi, sizes)], heads, kept


def _merge_runs(know: np.ndarray, sums: np.ndarray, members: np.ndarray,
                heads: np.ndarray, sizes: np.ndarray) -> None:
  """The rows of each group (`members[heads[g]:heads[g] + sizes[g]]`)
  become their maximum; `sums` `[N]`, the row sums, follow.

  Groups of sizes in `(w/2, w]` are padded to `w` rows by repeating their
  last member and merged in one gather (at most twice the rows; NumPy's
  row-wise `maximum.reduceat` is several times slower).
  """
  widths = np.left_shift(1, np.ceil(np.log2(sizes)).astype(np.int64))
  for width in np.unique(widths).tolist():
    mine = widths == width
    last = (sizes[mine] - 1)[:, None]
    rows = members[heads[mine][:, None] + np.minimum(np.arange(width), last)]
    merged = know[rows].max(axis=1)
    know[rows] = merged[:, None]
    sums[rows] = merged.sum(axis=1, dtype=sums.dtype)[:, None]


def _blocks(groups) -> list[np.ndarray]:
  """The groups of two or more, as one `[groups, size]` array per size.

  Takes a `[groups, size]` array or index arrays.
  """
  if isinstance(groups, np.ndarray):
    return [groups] if groups.ndim == 2 and groups.size and (
        groups.shape[1] > 1) else []
  by_size = {}
  for g in groups:
    if len(g) > 1:
      by_size.setdefault(len(g), []).append(g)
  return [np.stack(same) for same in by_size.values()]


def _merge(know: np.ndarray, sums: np.ndarray, groups: np.ndarray) -> None:
  """The rows of each group (`[groups, size]`) become their maximum; `sums`
  `[N]`, the row sums, follow."""
  if groups.shape[1] <= _FOLD:  # a few row gathers beat one 3-D gather
    merged = know[groups[:, 0]]
    for c in range(1, groups.shape[1]):
      np.maximum(merged, know[groups[:, c]], out=merged)
  else:
    merged = know[groups].max(axis=1)
  total = merged.sum(axis=1, dtype=sums.dtype)
  for c in range(groups.shape[1]):
    know[groups[:, c]] = merged
    sums[groups[:, c]] = total
