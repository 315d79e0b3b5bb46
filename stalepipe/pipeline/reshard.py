"""A pipeline's state carried onto another 'fsdp' size (`Pipeline.reshard`).

A state cut over F members (`fsdp.py`) holds each stage's leaves as packed
parts whose lengths and member axis depend on F, so a checkpoint cannot be
restored onto another F by resharding its arrays alone. Here each per-stage
field is fetched to the host, every position's parts merged into the
stage's whole tree (`Pipeline._whole`) and cut into the target's parts
(`Pipeline._held`): copies only, so there and back is bit for bit.
Activations and cotangents in flight across windows (an asynchronous
schedule's) are joined into whole micro-batches and split over the new
members. F = 1 (no member axis) is one of the sizes.
"""
# The functions here read the pipelines' layouts (their private helpers):
# pylint: disable=protected-access

import itertools
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from stalepipe.pipeline.state import Buffers, PipelineState, WeightRing


def _members(pipe, tree) -> Any:
  """`tree`'s host arrays `[D, P, F, ...]` (a member axis of one added
  where `pipe` has none)."""
  tree = jax.tree.map(pipe._fetch, tree)
  return tree if pipe._lead == 3 else jax.tree.map(lambda v: v[:, :, None],
                                                   tree)


def _placed(pipe, tree) -> Any:
  """Host arrays with a member axis onto `pipe`'s mesh, as it holds them."""
  if pipe._lead == 2:
    tree = jax.tree.map(lambda v: v[:, :, 0], tree)
  return jax.tree.map(lambda v: pipe._put(v, pipe._device_spec), tree)


def _convert(target, source, flat, j: int, opt: bool = False,
             extra: int = 0) -> dict:
  """Slot j's per-stage field `[D, P, F, *extra, ...]` per dtype, from
  `source`'s parts to `target`'s (`opt`: an optimizer state's layout;
  `extra`: axes between the member axis and the packed row, e.g. the ring's
  versions)."""
  flat = _members(source, flat)
  positions = next(iter(flat.values())).shape[3:3 + extra]
  out = {}
  for (d, p), idx in itertools.product(
      np.ndindex(target.num_replicas, target.placement.num_devices),
      np.ndindex(*positions)):
    s = int(target.placement.stages[p, j])
    at = (d, p, slice(None)) + idx
    part = {k: v[at] for k, v in flat.items()}
    if source._lead == 2:
      part = {k: v[0] for k, v in part.items()}
    held = target._held(s, source._whole(s, part, opt), opt)
    for k, v in held.items():
      v = v if target._lead == 3 else v[None]
      if k not in out:
        out[k] = np.zeros((target.num_replicas, target.placement.num_devices,
                           v.shape[0]) + positions + v.shape[1:], v.dtype)
      out[k][at] = v
  return _placed(target, out)


def _same_on_members(target, source, v):
  """A field every member holds the same (ring versions): member 0's."""
  v = _members(source, v)[:, :, :1]
  return _placed(target, np.broadcast_to(
      v, v.shape[:2] + (target.fsdp,) + v.shape[3:]).copy())


def _check(target, state: PipelineState, source) -> None:
  if (len(target.stage_fns) != len(source.stage_fns)
      or target.schedule.name != source.schedule.name
      or target.num_replicas != source.num_replicas
      or not np.array_equal(target.placement.stages,
                            source.placement.stages)):
    raise ValueError("reshard needs a source pipeline that differs only in "
                     "its 'fsdp' size; valid: the same stages, schedule, "
                     "replicas and placement")
  if target.pooled or source.pooled:
    raise ValueError('reshard of a pooled stash (stash="pooled") is not '
                     'supported; valid: stash="slots" on both pipelines')
  if jax.tree.leaves(state.sync):
    raise ValueError(f"resharding the state of sync policy "
                     f"{target.sync.name!r} is not supported; valid: a policy "
                     "without its own state (bsp, sdpipe, ad_psgd, local_sgd)")


def reshard(target, state: PipelineState, source) -> PipelineState:
  """`state`, held by pipeline `source`, as pipeline `target` holds it (the
  module docstring; `Pipeline.reshard`)."""
  _check(target, state, source)
  whole = lambda v: target._put(source._fetch(v), v.sharding.spec)  # pylint: disable=unnecessary-lambda-assignment
  new = state._replace(
      ring=tuple(WeightRing(
          params=_convert(target, source, r.params, j, extra=1),
          versions=_same_on_members(target, source, r.versions),
          latest=_same_on_members(target, source, r.latest))
                 for j, r in enumerate(state.ring)),
      opt_state=tuple(_convert(target, source, o, j, opt=True)
                      for j, o in enumerate(state.opt_state)),
      grads=tuple(_convert(target, source, g, j)
                  for j, g in enumerate(state.grads)),
      buffers=None, step=target._put(source._fetch(state.step), P()),
      history=None if state.history is None else jax.tree.map(
          lambda h: target._put(source._fetch(h), target._window_spec),
          state.history),
      drained=None if state.drained is None else whole(state.drained))
  if state.buffers is None or target.program.history == 0:
    return new  # nothing crosses a window: buffers are made at the step
  return new._replace(buffers=_resplit_buffers(target, state, source))


def _resplit_row(mine, theirs, unpack: str, pack: str, s: int, rows: list,
                 F: int, cotangent: bool) -> list:
  """One buffer row's F_source member rows as F (`target`'s) rows: the
  micro-batch joined over the members and split again, leaf by leaf.

  A leaf without a batch axis (an auxiliary loss carried on, its cotangent)
  holds each member's mean: the members' mean, on all. A member's cotangent
  is of its own sub-batch's mean loss, F times the whole micro-batch's
  (`fsdp.scatter_mean` divides), so cotangents are scaled.
  """
  scale = lambda x, n: x * n if cotangent and np.issubdtype(  # pylint: disable=unnecessary-lambda-assignment
      x.dtype, np.inexact) else x
  parts = [getattr(theirs, unpack)(s, row) for row in rows]
  joined = jax.tree.map(
      lambda *x: scale(np.concatenate(x), 1 / len(x)) if np.ndim(x[0])
      else np.mean(x, 0).astype(x[0].dtype), *parts)
  return [{k: np.asarray(v) for k, v in getattr(mine, pack)(s, jax.tree.map(
      lambda x, i=i: scale(np.split(x, F)[i], F).astype(x.dtype)
      if np.ndim(x) else x, joined)).items()} for i in range(F)]


def _resplit_buffers(target, state: PipelineState, source
                     ) -> tuple[Buffers, ...]:
  """`source`'s activation buffers with every row re-split over `target`'s
  members (`_resplit_row`): stage inputs and output cotangents."""
  B, S = target.schedule.num_minibatches, len(target.stage_fns)
  window = lambda tree: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
      lambda h: np.zeros((B,) + h.shape[1:], h.dtype), tree)
  inputs, targets = window(state.history.inputs), window(
      state.history.targets)
  mine = target._context(inputs, targets).boundaries
  theirs = source._context(inputs, targets).boundaries
  shapes = target._buffer_shapes(inputs, targets)
  empty = lambda field: {k: target._put(np.zeros(v, k), target._device_spec)  # pylint: disable=unnecessary-lambda-assignment
                         for k, v in field.items()}
  out = []
  for j, buffers in enumerate(state.buffers):
    fields = {}
    for name, unpack, pack, offset in (
        ("acts", "unpack_input", "pack_input", 0),
        ("cots", "unpack_cotangent", "pack_cotangent", 1)):
      flat = _members(source, getattr(buffers, name))
      D, num_devices, F_source, rows = next(iter(flat.values())).shape[:4]
      new = {k: np.zeros(v if target._lead == 3 else v[:2] + (1,) + v[2:], k)
             for k, v in getattr(shapes[j], name).items()}
      for d, p, c in np.ndindex(D, num_devices, rows):
        s = int(target.placement.stages[p, j]) + offset
        if s >= S:  # the last stage's outputs take no cotangent
          continue
        parts = _resplit_row(mine, theirs, unpack, pack, s, [
            {k: v[d, p, i, c] for k, v in flat.items()}
            for i in range(F_source)], target.fsdp, bool(offset))
        for i, row in enumerate(parts):
          for k, v in row.items():
            new[k][d, p, i, c] = v
      fields[name] = _placed(target, new)
    out.append(Buffers(fields["acts"], fields["cots"],
                       empty(shapes[j].residuals),
                       empty(shapes[j].op_cotangents)))
  return tuple(out)
