"""Packing pytrees of different structures into equal flat buffers.

In one SPMD program every device holds arrays of one shape, but pipeline
stages differ in structure. A `Packing` lays each stage's pytree out as one
flat vector per dtype, zero-padded to the longest stage, so that S stages
become per-dtype arrays `[S, L]` sharded over the 'stage' axis. Each stage
unpacks only its own row, with its own static layout.
"""

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Flat = dict[str, jax.Array]  # dtype name -> [L] (one stage) or [..., L]


class Packing:
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

  @property
  def num_stages(self) -> int:
    return len(self.trees)

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

  def unpack_all(self, flat: Flat) -> tuple[Any, ...]:
    """The inverse of `pack_all`."""
    return tuple(self.unpack(s, {k: v[s] for k, v in flat.items()})
                 for s in range(self.num_stages))
