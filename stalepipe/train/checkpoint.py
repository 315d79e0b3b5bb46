"""Checkpoints: the whole pipeline state and the trainer's position, by orbax.

A checkpoint holds the `PipelineState` pytree (weight versions and stashes,
optimizer states with their stale buffers and histories, activations in
flight, the input history, clocks and the window count) through
`ocp.args.StandardSave`, and the trainer's position plus the config's
fingerprint as JSON. Saves are asynchronous; orbax writes each step into a
temporary directory and renames it when complete, and retires old steps
(beyond `keep`) only after a newer one is finalised, by renaming them into
`deleted/` before removing them, so the last good checkpoint always survives
a crash mid-save and no half-deleted step is ever taken for a checkpoint.

What is restored is verified: each save records a checksum of every state
leaf (computed on the devices, position-weighted, so one flipped byte
changes it) and a SHA-256 of the position record itself, and a restore
recomputes both and checks the state finite. A
checkpoint that fails (unreadable, empty, flipped bytes, non-finite) is moved
to `corrupt/<step>`, kept for inspection, and the next older one is tried;
`Checkpointer.skipped` says which and why.
"""

import hashlib
import json
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# Fields that may change between a run and its resumption.
RESUMABLE_CHANGES = frozenset({"num_steps", "log_every", "eval_every",
                               "checkpoint_every", "keep_checkpoints",
                               "plots", "hooks", "device_memory_mib",
                               "tick"})
# Fields newer than some checkpoints: a checkpoint without one was written
# with this value of it.
ABSENT_MEANS = {"fsdp": 1, "stash": "slots"}


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


# Not a config field, but what the run computes in: float32 or float64.
PRECISION = "jax_enable_x64"


def fingerprint(config_dict: dict[str, Any]) -> dict[str, Any]:
  """The config fields a checkpoint must agree with to be resumed, and the
  precision this process computes in (`PRECISION`)."""
  return {**{k: v for k, v in config_dict.items()
             if k not in RESUMABLE_CHANGES},
          PRECISION: bool(jax.config.jax_enable_x64)}


def changed_fields(saved: dict[str, Any], config_dict: dict[str, Any]
                   ) -> list[str]:
  """The fields of `fingerprint(config_dict)` that `saved` (a fingerprint,
  or a whole config) holds otherwise, sorted; the precision only where
  `saved` records one."""
  current = fingerprint(config_dict)
  if PRECISION not in saved:
    del current[PRECISION]
  saved = {k: v for k, v in saved.items() if k not in RESUMABLE_CHANGES}
  value = lambda d, k: d.get(k, ABSENT_MEANS.get(k))  # pylint: disable=unnecessary-lambda-assignment
  return sorted(k for k in saved.keys() | current.keys()
                if value(saved, k) != value(current, k))


class CheckpointError(RuntimeError):
  """A checkpoint could not be written (disk full, no permission, ...)."""


@jax.jit
def _checksums(flat: dict[str, Any]) -> dict[str, jax.Array]:
  """A uint32 checksum per leaf: its raw bits, each word position-weighted.

  The weights are odd, so changing any one word changes the sum mod 2**32.
  """
  def one(x):
    if x.dtype == jnp.bool_:
      words = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
      words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
      unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
      words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    # The flat index of every word, without a reshape (arrays are sharded).
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
      index += (jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
                * jnp.uint32(stride))
      stride *= words.shape[axis]
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(2654435761)
    return jnp.sum(words * weights, dtype=jnp.uint32)
  return {k: one(v) for k, v in flat.items()}


def checksums(flat: dict[str, Any]) -> dict[str, int]:
  """`_checksums` as plain ints (JSON)."""
  return {k: int(v) for k, v in jax.device_get(_checksums(flat)).items()}


@jax.jit
def _finite(flat: dict[str, Any]) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in flat.values()
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


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
    self.skipped: list[str] = []  # "DIR/N (why)" per checkpoint skipped
    self.restored_from: int | None = None  # the directory `restore` read
    self._saved_step: int | None = None  # the step this object last saved
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "position"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True,
            todelete_subdir="deleted"))

  def latest_step(self) -> int | None:
    """The newest finished checkpoint's name (its step), or None."""
    return self._manager.latest_step()

  def saved_config(self) -> dict[str, Any]:
    """The config fingerprint the newest checkpoint records ({} where it
    records none or cannot be read): e.g. to restore a state held on
    another 'fsdp' size before resharding it."""
    step = self.latest_step()
    if step is None:
      return {}
    try:
      position = self._manager.restore(step, args=ocp.args.Composite(
          position=ocp.args.JsonRestore()))["position"]
    except Exception:  # pylint: disable=broad-except
      return {}
    return dict(position.get("config", {}))

  def save(self, step: int, state: Any, position: dict[str, Any],
           config_dict: dict[str, Any]) -> None:
    """Starts an asynchronous save of `state` and `position` as `step`.

    Raises:
      CheckpointError: if this or the previous (asynchronous) save failed.
    """
    if step == self._saved_step:
      return  # the same step's state again (a preemption in a save window)
    flat = _flat(state)
    position = dict(position, config=fingerprint(config_dict),
                    checksums=checksums(flat))
    position["position_sha256"] = _position_sum(position)
    self._empty_deleted()  # retired steps never pile up during a run
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(flat),
          position=ocp.args.JsonSave(position)), force=True)
    except Exception as e:  # orbax raises many types; all mean not saved
      raise CheckpointError(f"saving checkpoints in {self.directory} failed "
                            f"at step {step}: {_one_line(e)}") from e
    self._saved_step = step
    self._empty_deleted()  # the step this save retired

  def restore(self, abstract_state: Any, config_dict: dict[str, Any]
              ) -> tuple[Any, dict[str, Any]] | None:
    """The newest checkpoint that verifies, or None if there is none.

    A checkpoint that does not verify is moved to `corrupt/<step>` and
    noted in `self.skipped`, and the next older one is tried.

    Args:
      abstract_state: the state's structure, `jax.ShapeDtypeStruct` leaves
        with shardings (where each shard is restored to).
      config_dict: the current config, checked against the saved one.

    Returns:
      `(state, position)`.

    Raises:
      ValueError: if no checkpoint verifies, or the newest readable one
        belongs to a different experiment or holds a state of another
        layout (written by another version of stalepipe), naming them.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      path = os.path.join(self.directory, str(step))
      try:
        position = self._manager.restore(step, args=ocp.args.Composite(
            position=ocp.args.JsonRestore()))["position"]
      except Exception as e:  # orbax raises many types; all mean unreadable
        self._skip(step, f"corrupt: {_one_line(e)}")
        continue
      saved_sum = position.pop("position_sha256", None)
      if saved_sum is not None and saved_sum != _position_sum(position):
        self._skip(step, "position record checksum mismatch")
        continue
      changed = changed_fields(position.pop("config", {}), config_dict)
      if changed:
        raise ValueError(f"checkpoint {path} is incompatible with this config "
                         f"(fields {', '.join(changed)} differ); valid: the "
                         "config it was written with, or a new --workdir")
      saved_sums = position.pop("checksums", None)
      if saved_sums is not None:
        _check_layout(path, saved_sums, abstract_state)
      try:
        state = self._restore_state(step, abstract_state, saved_sums)
      except ValueError as e:
        self._skip(step, str(e))
        continue
      self.restored_from = step
      return state, position
    if self.skipped:
      raise ValueError(f"no checkpoint in {self.directory} verifies: "
                       f"{'; '.join(self.skipped)}; they are kept under "
                       f"{self.directory}/corrupt; valid: a workdir with an "
                       "intact checkpoint, or a new --workdir")
    return None

  def _restore_state(self, step: int, abstract_state: Any,
                     saved_sums: dict[str, int] | None) -> Any:
    """Step `step`'s state, verified; ValueError (one line) saying why not."""
    try:
      flat = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_flat(abstract_state))))["state"]
    except Exception as e:  # orbax raises many types; all mean unreadable
      raise ValueError(f"corrupt: {_one_line(e)}") from e
    if saved_sums is not None:
      bad = sorted(k for k, v in checksums(flat).items()
                   if saved_sums.get(k) != v)
      if bad:
        raise ValueError(f"checksum mismatch in {', '.join(bad[:3])}"
                         f"{' ...' if len(bad) > 3 else ''}")
    if not bool(_finite(flat)):
      raise ValueError("the restored state is not finite")
    return _unflat(abstract_state, flat)

  def _skip(self, step: int, why: str) -> None:
    self.skipped.append(f"{self.directory}/{step} ({why})")
    self._set_aside(step)

  def _set_aside(self, step: int) -> None:
    """Moves a bad step out of orbax's sight (it would block later saves)."""
    if jax.process_index() == 0:
      aside = os.path.join(self.directory, "corrupt")
      os.makedirs(aside, exist_ok=True)
      target = os.path.join(aside, str(step))
      while os.path.exists(target):
        target += "_"
      os.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint set aside {step}")
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until pending saves are complete; then empties `deleted/`.

    Raises:
      CheckpointError: if a pending save failed.
    """
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # orbax raises many types; all mean not saved
      raise CheckpointError(f"saving checkpoints in {self.directory} "
                            f"failed: {_one_line(e)}") from e
    self._empty_deleted()

  def _empty_deleted(self) -> None:
    """Removes the steps orbax has retired into `deleted/` (each was renamed
    there whole after a newer step was finalised: never a checkpoint).

    `deleted/` itself stays: orbax's finaliser creates it and then renames a
    step into it from its own thread, and removing the directory between the
    two fails that save.
    """
    if jax.process_index() != 0:
      return
    retired = os.path.join(self.directory, "deleted")
    try:
      names = os.listdir(retired)
    except FileNotFoundError:
      return
    for name in names:
      shutil.rmtree(os.path.join(retired, name), ignore_errors=True)

  def close(self) -> None:
    """Stops orbax's threads; safe after a failed save."""
    try:
      self._manager.close()
    except Exception:  # pylint: disable=broad-except
      pass  # the failure was reported by save or wait


def _check_layout(path: str, saved_sums: dict[str, int],
                  abstract_state: Any) -> None:
  """Refuses (one line) a checkpoint whose state leaves are not the ones
  this pipeline holds: it was written by another version of stalepipe (its
  state laid out otherwise), not corrupted, so it is left where it is."""
  saved, current = set(saved_sums), set(_flat(abstract_state))
  if saved != current:
    differ = sorted(saved ^ current)
    raise ValueError(
        f"checkpoint {path} holds a state laid out otherwise than this "
        f"version of stalepipe lays it out (leaves {', '.join(differ[:2])}"
        f"{' ...' if len(differ) > 2 else ''} differ); valid: the version "
        "that wrote it, or a new --workdir")


def _position_sum(position: dict[str, Any]) -> str:
  """SHA-256 of the position record (the trainer's step, the config's
  fingerprint, the state's checksums) as canonical JSON."""
  text = json.dumps(position, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def _one_line(e: Exception) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  return text if len(text) <= 300 else f"{text[:150]} ... {text[-150:]}"
