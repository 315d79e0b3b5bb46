"""Staleness-aware learning rate: divide each update by its staleness."""

from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax


def _key(entry) -> tuple[str, Any]:
  """A path entry by kind and name, so dict, FrozenDict and nnx.State agree."""
  if isinstance(entry, jax.tree_util.SequenceKey):
    return ("index", entry.idx)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return ("attr", entry.name)
  if isinstance(entry, jax.tree_util.DictKey):
    return ("key", entry.key)
  return ("key", getattr(entry, "key", entry))


def _path(path) -> tuple[tuple[str, Any], ...]:
  return tuple(_key(entry) for entry in path)


def match_leaves(values: Any, tree: chex.ArrayTree, name: str) -> chex.ArrayTree:
  """`values` (scalars) placed on the leaves of `tree`, matched by key paths.

  A scalar applies to every leaf. Otherwise `values` is a pytree of scalars
  whose key paths are prefixes of `tree`'s, as an `optax.masked` mask is a
  prefix of the params; matching goes by key, not by container type, so a
  plain dict matches a `FrozenDict` or an `nnx.State`. Every leaf of `tree`
  must be covered and every value must cover some leaf; anything else (a
  list against a dict, a vector for a single array) raises.

  Args:
    values: a scalar or a pytree of scalars.
    tree: the pytree to place them on.
    name: the argument's name, for errors.

  Returns:
    A pytree like `tree` whose leaves are the matching values.
  """
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(values)) and (
      jnp.ndim(values) == 0):
    return jax.tree.map(lambda _: values, tree)
  keyed = {}
  for path, value in jax.tree_util.tree_flatten_with_path(values)[0]:
    if jnp.ndim(value) != 0:
      where = jax.tree_util.keystr(path) or "itself"
      raise ValueError(f"{name} of shape {jnp.shape(value)} at {where} is "
                       "ambiguous; valid: a scalar, or a pytree of scalars "
                       "whose keys match the params' (or a prefix of them)")
    keyed[_path(path)] = value
  used = set()

  def place(path, _):
    path = _path(path)
    for k in range(len(path) + 1):
      if path[:k] in keyed:
        used.add(path[:k])
        return keyed[path[:k]]
    raise ValueError(f"{name} has no entry for parameter "
                     f"{_keystr(path)}; valid: a scalar, or a pytree whose "
                     f"keys match the params' (or a prefix), e.g. "
                     f"{_keystr(path[:1])}")
  placed = jax.tree_util.tree_map_with_path(place, tree)
  unused = sorted(set(keyed) - used, key=str)
  if unused:
    raise ValueError(f"{name} entry {_keystr(unused[0])} matches no "
                     "parameter; valid: keys that are the params' (or a "
                     "prefix of them)")
  return placed


def _keystr(path) -> str:
  return "".join(f"[{v!r}]" if kind != "attr" else f".{v}"
                 for kind, v in path) or "(the whole tree)"


class ScaleByStalenessState(NamedTuple):
  """`scale_by_staleness` keeps no state."""


def scale_by_staleness(
    staleness: Optional[chex.Numeric] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Scales updates by :math:`1/\max(\tau, 1)`: the staleness-aware rate.

  .. math::
    u \leftarrow \frac{u}{\max(\tau, 1)}

  so chained after `optax.sgd(lr)` the step size is :math:`\eta / \tau`.
  :math:`\tau` is fixed here, or given per call as the extra argument
  `staleness=` (asynchronous training, where each gradient has its own). A
  pytree gives per-leaf or per-stage staleness: its keys must be the params'
  keys or a prefix of them (`{"stage0": 1, "stage1": 3}` for params
  `{"stage0": {...}, "stage1": {...}}`), matched by key the way an
  `optax.masked` mask is, so a dict matches `nnx.State` and `FrozenDict`
  params. Anything ambiguous (a list against named params, a vector, a key
  that names no parameter) raises a ValueError; nothing is broadcast
  silently.

  Args:
    staleness: :math:`\tau`, a number or a pytree of numbers keyed like the
      params (or a prefix of them); `None` requires `staleness=` on every
      call.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(optax.sgd(1.0), scale_by_staleness())
    >>> state = opt.init(jnp.zeros(()))
    >>> updates, _ = opt.update(jnp.asarray(4.0), state, staleness=2)
    >>> float(updates)
    -2.0

  References:
    Zhang et al, `Staleness-Aware Async-SGD for Distributed Deep Learning
    <https://arxiv.org/abs/1511.05950>`_, 2016 (SAPipe [32]).
  """

  def init_fn(params):
    del params
    return ScaleByStalenessState()

  def update_fn(updates, state, params=None, *, staleness=staleness,
                **extra_args: Any):
    del params, extra_args
    if staleness is None:
      raise ValueError("scale_by_staleness got staleness=None; valid: a number"
                       " or pytree, at construction or as an update argument")
    taus = match_leaves(staleness, updates, "staleness")
    return jax.tree.map(
        lambda u, tau: (u / jnp.maximum(jnp.asarray(tau, u.dtype), 1)).astype(
            u.dtype), updates, taus), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
