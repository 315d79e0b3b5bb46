"""Checkpoints: the whole pipeline state and the trainer's position, by orbax.

A checkpoint holds the `PipelineState` pytree (weight versions and stashes,
optimizer states with their stale buffers and histories, activations in
flight, the input history, clocks and the window count) through
`ocp.args.StandardSave`, and the trainer's position plus the config's
fingerprint as JSON. Saves are asynchronous; orbax writes each step into a
temporary directory and renames it when complete, and deletes old steps
(beyond `keep`) only after a newer one is finalised, so the last good
checkpoint always survives a crash mid-save.
"""

import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

# Fields that may change between a run and its resumption.
RESUMABLE_CHANGES = frozenset({"num_steps", "log_every", "eval_every",
                               "checkpoint_every", "keep_checkpoints",
                               "plots"})


def _key(path) -> str:
  """A file-name-safe key for a leaf's tree path."""
  return re.sub(r"\W+", "_", jax.tree_util.keystr(path)).strip("_") or "leaf"


def _flat(tree: Any) -> dict[str, Any]:
  """The leaves of `tree` by path."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = _key(path)
    if key in flat:
      raise ValueError(f"two state leaves map to checkpoint key {key!r}; "
                       "valid: leaf paths that differ in more than "
                       "punctuation")
    flat[key] = leaf
  return flat


def _unflat(abstract: Any, flat: dict[str, Any]) -> Any:
  """`abstract`'s structure with the leaves of `flat`."""
  return jax.tree_util.tree_map_with_path(lambda path, _: flat[_key(path)],
                                          abstract)


def fingerprint(config_dict: dict[str, Any]) -> dict[str, Any]:
  """The config fields a checkpoint must agree with to be resumed."""
  return {k: v for k, v in config_dict.items() if k not in RESUMABLE_CHANGES}


class Checkpointer:
  """Saves and restores `(state, position)` under `directory`.

  Args:
    directory: where the numbered step directories go.
    keep: how many of the latest checkpoints to keep.

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=1)
    >>> ckpt.save(3, {"w": jnp.ones(2)}, {"window": 3}, {"seed": 0})
    >>> ckpt.wait()
    >>> state, position = ckpt.restore({"w": jnp.zeros(2)}, {"seed": 0})
    >>> state["w"].tolist(), position["window"]
    ([1.0, 1.0], 3)
    >>> ckpt.close()
  """

  def __init__(self, directory: str, keep: int):
    if keep < 1:
      raise ValueError(f"keep_checkpoints={keep} is invalid; valid: >= 1")
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "position"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True))

  def latest_step(self) -> int | None:
    """The newest finished checkpoint's window, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, position: dict[str, Any],
           config_dict: dict[str, Any]) -> None:
    """Starts an asynchronous save of `state` and `position` as `step`."""
    position = dict(position, config=fingerprint(config_dict))
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_flat(state)),
        position=ocp.args.JsonSave(position)), force=True)

  def restore(self, abstract_state: Any, config_dict: dict[str, Any]
              ) -> tuple[Any, dict[str, Any]] | None:
    """The latest checkpoint, or None if there is none.

    Args:
      abstract_state: the state's structure, `jax.ShapeDtypeStruct` leaves
        with shardings (where each shard is restored to).
      config_dict: the current config, checked against the saved one.

    Returns:
      `(state, position)`.

    Raises:
      ValueError: if the checkpoint is corrupt or belongs to a different
        experiment, naming it.
    """
    step = self._manager.latest_step()
    if step is None:
      return None
    path = os.path.join(self.directory, str(step))
    try:
      position = self._manager.restore(step, args=ocp.args.Composite(
          position=ocp.args.JsonRestore()))["position"]
    except Exception as e:  # orbax raises many types; all mean unreadable
      raise ValueError(f"checkpoint {path} is corrupt: {_one_line(e)}") from e
    saved, current = position.pop("config", {}), fingerprint(config_dict)
    changed = sorted(k for k in saved.keys() | current.keys()
                     if saved.get(k) != current.get(k))
    if changed:
      raise ValueError(f"checkpoint {path} is incompatible with this config "
                       f"(fields {', '.join(changed)} differ); valid: the "
                       "config it was written with, or a new --workdir")
    try:
      flat = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_flat(abstract_state))))["state"]
    except Exception as e:  # orbax raises many types; all mean unreadable
      raise ValueError(f"checkpoint {path} is corrupt or incompatible: "
                       f"{_one_line(e)}") from e
    return _unflat(abstract_state, flat), position

  def wait(self) -> None:
    """Blocks until pending saves are complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _one_line(e: Exception) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return text[:300]
