"""Packing pytrees of different structures into equal flat buffers.

In one SPMD program every device holds arrays of one shape, but pipeline
stages differ in structure. A `Packing` lays each stage's pytree out as one
flat vector per dtype, zero-padded to the longest stage, so that S stages
become per-dtype arrays `[S, L]` sharded over the 'stage' axis. Each stage
unpacks only its own row, with its own static layout.
"""

import bisect
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Flat = dict[str, jax.Array]  # dtype name -> [L] (one stage) or [..., L]
Pieces = dict[str, Any]  # a layout's parts of a Flat, one shape on all stages


class _Layout:
  """What both layouts share: S stage pytrees, unpacked one stage at a
  time (a subclass defines `trees` and `unpack`)."""

  trees: tuple

  @property
  def num_stages(self) -> int:
    return len(self.trees)

  def unpack_all(self, flat: Flat) -> tuple[Any, ...]:
    """The inverse of `pack_all`."""
    return tuple(self.unpack(s, {k: v[s] for k, v in flat.items()})
                 for s in range(self.num_stages))


class Packing(_Layout):
  """The flat layout of `S` pytrees (one per stage), grouped by dtype.

  Examples:
    >>> import numpy as np
    >>> p = Packing([{"w": np.ones(3, np.float32)},
    ...              {"w": np.ones(5, np.float32), "n": np.int32(2)}])
    >>> {k: v.shape for k, v in p.pack_all(p.trees).items()}
    {'float32': (2, 5), 'int32': (2, 1)}
  """

  def __init__(self, trees: Sequence[Any]):
    self.trees = tuple(trees)
    self.treedefs = []
    self.slots = []  # per stage, per leaf: (dtype name, offset, shape)
    totals = {}
    for tree in self.trees:
      leaves, treedef = jax.tree.flatten(tree)
      used, slots = {}, []
      for leaf in leaves:
        dtype = jnp.dtype(leaf.dtype).name
        shape = tuple(np.shape(leaf))
        slots.append((dtype, used.get(dtype, 0), shape))
        used[dtype] = used.get(dtype, 0) + int(np.prod(shape, dtype=np.int64))
      for dtype, n in used.items():
        totals[dtype] = max(totals.get(dtype, 0), n)
      self.treedefs.append(treedef)
      self.slots.append(slots)
    self.lengths = {k: max(totals[k], 1) for k in sorted(totals)}
    # Every stage's leaf boundaries, per dtype: between two neighbours each
    # stage has (part of) one leaf or padding.
    cuts = {k: {0, n} for k, n in self.lengths.items()}
    for slots in self.slots:
      for dtype, offset, shape in slots:
        cuts[dtype] |= {offset, offset + int(np.prod(shape, dtype=np.int64))}
    self.cuts = {k: sorted(v) for k, v in cuts.items()}

  @property
  def row_bytes(self) -> int:
    """Bytes of one stage's packed row, all dtypes."""
    return sum(n * np.dtype(k).itemsize for k, n in self.lengths.items())

  def pack(self, stage: int, tree: Any) -> Flat:
    """Stage `stage`'s pytree as zero-padded flat vectors (traceable)."""
    parts = {k: [] for k in self.lengths}
    for leaf, (dtype, _, _) in zip(jax.tree.leaves(tree), self.slots[stage]):
      parts[dtype].append(jnp.ravel(leaf).astype(dtype))
    flat = {}
    for dtype, length in self.lengths.items():
      vec = (jnp.concatenate(parts[dtype]) if parts[dtype]
             else jnp.zeros((0,), dtype))
      flat[dtype] = jnp.pad(vec, (0, length - vec.shape[0]))
    return flat

  def pieces(self, stage: int, tree: Any) -> Pieces:
    """Stage `stage`'s pytree cut at every stage's leaf boundaries (traceable):
    `join(pieces(s, t)) == pack(s, t)`, and the pieces have one shape on
    every stage.

    A weight gradient leaves its task's conditional as pieces and is joined
    where it is added to the accumulator, in one fused pass: packed inside
    the branch, it would be written once more, by a concatenate that XLA:CPU
    spreads over the intra-op pool (docs/executor.md). Where the stages
    share a structure each piece is a whole leaf, raveled in place.
    """
    pieces = {}
    for dtype, cuts in self.cuts.items():
      # This stage's leaves of `dtype`, in increasing offsets (as laid out).
      leaves = [(offset, jnp.ravel(leaf).astype(dtype)) for leaf, (d, offset, _)
                in zip(jax.tree.leaves(tree), self.slots[stage]) if d == dtype]
      offsets = [offset for offset, _ in leaves]
      row = []
      for start, stop in zip(cuts[:-1], cuts[1:]):
        i = bisect.bisect_right(offsets, start) - 1  # the leaf starting last
        offset, vec = leaves[i] if i >= 0 else (0, jnp.zeros((0,), dtype))
        if stop <= offset + vec.shape[0]:
          piece = (vec if vec.shape[0] == stop - start else
                   jax.lax.slice(vec, (start - offset,), (stop - offset,)))
        else:  # padding past this stage's leaves
          piece = jnp.zeros((stop - start,), dtype)
        row.append(piece)
      pieces[dtype] = tuple(row)
    return pieces

  def join(self, pieces: Pieces) -> Flat:
    """`pieces` as the packed row `pack` would give (traceable)."""
    return {k: v[0] if len(v) == 1 else jnp.concatenate(v)
            for k, v in pieces.items()}

  def unpack(self, stage: int, flat: Flat) -> Any:
    """The inverse of `pack` for stage `stage` (traceable)."""
    leaves = [
        jax.lax.slice(flat[dtype], (offset,),
                      (offset + int(np.prod(shape, dtype=np.int64)),)
                      ).reshape(shape)
        for dtype, offset, shape in self.slots[stage]]
    return jax.tree.unflatten(self.treedefs[stage], leaves)

  def pack_all(self, trees: Sequence[Any]) -> Flat:
    """All stages stacked: dtype name -> `[S, L]`."""
    packed = [self.pack(s, t) for s, t in enumerate(trees)]
    return {k: jnp.stack([p[k] for p in packed]) for k in self.lengths}

class Stacking(_Layout):
  """`Packing`'s interface for stages that share one structure: leaf i of
  every stage under the key `"%04d" % i`, in its own shape, so stage s's
  weights are `[..., *shape]` arrays read in place and a gradient adds leaf
  by leaf (no flat row to slice or concatenate; MaxText stacks its stages
  the same way).

  Examples:
    >>> import numpy as np
    >>> t = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    >>> st = Stacking([t, t])
    >>> {k: v.shape for k, v in st.pack_all(st.trees).items()}
    {'0000': (2, 3), '0001': (2, 2, 3)}
  """

  def __init__(self, trees: Sequence[Any]):
    self.trees = tuple(trees)
    leaves, self.treedef = jax.tree.flatten(self.trees[0])
    self.shapes = [jax.ShapeDtypeStruct(np.shape(v), jnp.dtype(v.dtype))
                   for v in leaves]
    for s, tree in enumerate(self.trees[1:], start=1):
      if not shares_structure(self.trees[0], tree):
        raise ValueError(f"stage {s}'s pytree differs from stage 0's in "
                         "structure, shape or dtype; valid for a stacked "
                         "layout: stages of one structure (else 'packed')")
    self.keys = [f"{i:04d}" for i in range(len(leaves))]

  @property
  def row_bytes(self) -> int:
    """Bytes of one stage's weights, all leaves."""
    return sum(int(np.prod(v.shape, dtype=np.int64)) * v.dtype.itemsize
               for v in self.shapes)

  def pack(self, stage: int, tree: Any) -> Flat:
    del stage
    return dict(zip(self.keys, (jnp.asarray(v, s.dtype) for v, s in
                                zip(jax.tree.leaves(tree), self.shapes))))

  def pieces(self, stage: int, tree: Any) -> Pieces:
    """`Packing.pieces`' interface: the leaves themselves."""
    return self.pack(stage, tree)

  def join(self, pieces: Pieces) -> Flat:
    """The leaves are the layout's keys already."""
    return pieces

  def unpack(self, stage: int, flat: Flat) -> Any:
    del stage
    return jax.tree.unflatten(self.treedef, [flat[k] for k in self.keys])

  def pack_all(self, trees: Sequence[Any]) -> Flat:
    """All stages stacked: key -> `[S, *shape]`."""
    leaves = [jax.tree.leaves(t) for t in trees]
    return {k: np.stack([np.asarray(stage[i]) for stage in leaves])
            for i, k in enumerate(self.keys)}


def shares_structure(a: Any, b: Any) -> bool:
  """Whether two pytrees have one treedef and equal leaf shapes and dtypes."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(
      np.shape(x) == np.shape(y) and jnp.dtype(x.dtype) == jnp.dtype(y.dtype)
      for x, y in zip(la, lb))


LAYOUTS = {"packed": Packing, "stacked": Stacking}


def get(name: str) -> type[_Layout]:
  """The layout registered under `name`."""
  if name not in LAYOUTS:
    raise ValueError(f"layout {name!r} is invalid; valid: "
                     f"{', '.join(LAYOUTS)}")
  return LAYOUTS[name]
