"""The value ranges of a run config and the checks that span its fields.

`check(config)` raises `ValueError` with one line naming the key, the value
and what is valid. Which keyword arguments a schedule, sync policy, update
rule, optimizer, model or dataset accepts is read from its plane's registry
(`stalepipe.registry.Registry`), the one declaration of its options; the
value ranges are declared here, in one place. It is the first half of
checking a config; `stalepipe.train.build.parts` is the second: it builds
every part, so what the check accepts builds.

Examples:
  >>> import sys; sys.path.insert(0, ".")
  >>> from configs import default
  >>> config = default.get_config()
  >>> check(config)
  >>> config.optimizer_kwargs.learning_rate = -1.0
  >>> check(config)
  Traceback (most recent call last):
  ...
  ValueError: optimizer_kwargs.learning_rate=-1.0 is invalid; valid: a number > 0
"""

import math
import os
from typing import Any

from stalepipe import data as data_lib
from stalepipe import models
from stalepipe import optim
from stalepipe import registry
from stalepipe import schedules
from stalepipe import sync as sync_lib
from stalepipe.models import losses
from stalepipe.pipeline import placement as placement_lib
from stalepipe.pipeline import lanes as lanes_lib
from stalepipe.pipeline import pool as pool_lib
from stalepipe.pipeline import residuals as residuals_lib
from stalepipe.pipeline import scope as scope_lib
from stalepipe.train import optimizers

# Ranges as (test, what is valid). A key absent here is checked for its
# name only, and by its own factory when the run is built.
_POSITIVE_INT = (lambda v: _is_int(v) and v >= 1, "an integer >= 1")
_NATURAL_INT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_POSITIVE = (lambda v: _is_number(v) and v > 0, "a number > 0")
_NON_NEGATIVE = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
_FRACTION = (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)")
_BOOL = (lambda v: isinstance(v, bool), "True or False")

_SEED = (lambda v: _is_int(v) and 0 <= v < 2**32, "an integer in [0, 2**32)")
TOP_LEVEL = {
    "seed": _SEED,
    "num_stages": _POSITIVE_INT,
    "stage_devices": (_NATURAL_INT[0], "an integer >= 0 (0: num_stages)"),
    "num_replicas": _POSITIVE_INT,
    "num_microbatches": _POSITIVE_INT,
    "microbatch_size": _POSITIVE_INT,
    "minibatches_per_window": _POSITIVE_INT,
    "num_steps": _POSITIVE_INT,
    "log_every": _POSITIVE_INT,
    "eval_every": (_NATURAL_INT[0], "an integer >= 0 (0: only at the end)"),
    "checkpoint_every": (_NATURAL_INT[0],
                         "an integer >= 0 (0: only at the end)"),
    "keep_checkpoints": _POSITIVE_INT,
    "plots": _BOOL,
    "num_chunks": _POSITIVE_INT,
    "fsdp": _POSITIVE_INT,
    "device_memory_mib": (_NON_NEGATIVE[0], "a number >= 0 (0: no limit)"),
}
SCHEDULE_KWARGS = {"concurrent_minibatches": _POSITIVE_INT,
                   "vertical_sync": _BOOL}
SYNC_KWARGS = {"clock_distance": _NATURAL_INT,
               "concurrent_minibatches": _POSITIVE_INT,
               "history": _POSITIVE_INT, "window": _POSITIVE,
               "enforce": _BOOL, "seed": _NATURAL_INT,
               "period": _POSITIVE_INT,
               "server": (lambda v: v in ("sum", "mean"), "'sum' or 'mean'"),
               # SDPipe's groups across iterations: the simulator's only.
               "grouping": (lambda v: v == "iteration",
                            "'iteration' (a run trains on the lockstep "
                            "executor; 'arrival' is the simulator's only)")}
TRANSFORM_KWARGS = {
    "delay": _NATURAL_INT, "lam": _NON_NEGATIVE,
    "form": (lambda v: v in ("diagonal", "full"), "'diagonal' or 'full'"),
    "adaptive": (lambda v: v in (None, "ema", "current"),
                 "None, 'ema' or 'current'"),
    "eps": _POSITIVE, "decay": _FRACTION, "b1": _FRACTION, "b2": _FRACTION,
    "num_workers": _POSITIVE_INT, "wave_size": _POSITIVE_INT,
    "staleness": (lambda v: v in optim.SpecTrain.STALENESS
                  or _NON_NEGATIVE[0](v),
                  "a number >= 0 (scale_by_staleness), or 'pipeline' or "
                  "'minibatch' (SpecTrain)"),
    "option": (lambda v: v in (1, 2, 3), "1, 2 or 3"),
    "warmup_steps": _NATURAL_INT,
}


def _if_number(rule):
  """`rule` for numbers; other values (a schedule given by name) pass."""
  test, valid = rule
  return (lambda v: not isinstance(v, (int, float)) or test(v), valid)


OPTIMIZER_KWARGS = {k: _if_number(r) for k, r in {
    "learning_rate": _POSITIVE, "momentum": _FRACTION, "b1": _FRACTION,
    "b2": _FRACTION, "eps": _POSITIVE, "weight_decay": _NON_NEGATIVE}.items()}
def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
  return (isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v))


def _fail(key: str, value: Any, valid: str):
  raise ValueError(f"{key}={value!r} is invalid; valid: {valid}")


def _check_range(key: str, value: Any, rule) -> None:
  test, valid = rule
  if not test(value):
    _fail(key, value, valid)


def _check_kwargs(prefix: str, parts: registry.Registry, name: str,
                  kwargs: dict[str, Any], ranges: dict[str, Any]) -> None:
  """Keys against the registered factory's, required ones present, ranges."""
  owner = f"{parts.plane} {name!r}"
  accepted = parts.keys(name)
  for key, value in kwargs.items():
    if key not in accepted and not parts.takes_any(name):
      raise ValueError(f"{prefix}.{key}={value!r} is invalid: {owner} takes "
                       f"no {key!r}; valid keys: "
                       f"{', '.join(accepted) or 'none'}")
    if key in ranges:
      _check_range(f"{prefix}.{key}", value, ranges[key])
  filled = _FILLED_BY_THE_RUN.get(parts.plane, ())
  if parts is optim.TRANSFORMS and name in optim.MIRRORS:
    filled += ("learning_rate",)  # the optimizer's (`optimizers.make`)
  for key in parts.required(name):
    if key not in kwargs and key not in filled:
      valid = ranges[key][1] if key in ranges else "a value"
      raise ValueError(f"{prefix}.{key} is missing: {owner} needs it; "
                       f"valid: {valid}")


# Keys the run fills in where a config leaves them out (`build.parts`,
# `optimizers.make`): WSP's wave is the schedule's concurrent minibatches,
# and a rule's workers are the data replicas (a transform that mirrors the
# optimizer, `optim.MIRRORS`, also gets its learning rate).
_FILLED_BY_THE_RUN = {"sync policy": ("concurrent_minibatches",),
                      "transform": ("num_workers",),
                      "optimizer wrapper": ("num_workers",)}
_FIELDS = {"schedule_kwargs": schedules.PARTS, "sync_kwargs": sync_lib.PARTS,
           "model_kwargs": models.PARTS, "dataset_kwargs": data_lib.PARTS,
           "optimizer_kwargs": optimizers.OPTIMIZERS}


def accepted_keys(field: str, name: str) -> tuple[str, ...] | None:
  """The keys `field` (e.g. "schedule_kwargs") takes for the part `name`.

  None where `field` is not such a field or `name` is not registered.
  """
  parts = _FIELDS.get(field)
  if parts is None or name not in parts.names():
    return None
  return parts.keys(name)


def _check_top_level(config) -> None:
  for key, rule in TOP_LEVEL.items():
    if key in config:
      _check_range(key, config[key], rule)
  B = config.minibatches_per_window
  if config.num_steps % B:
    _fail("num_steps", config.num_steps,
          f"a positive multiple of minibatches_per_window={B}")
  shape = tuple(config.input_shape)
  if not all(_is_int(n) and n >= 1 for n in shape):
    _fail("input_shape", shape, "() or a tuple of integers >= 1")
  bounds = tuple(config.stage_boundaries)
  if bounds and (not all(_is_int(n) and n >= 0 for n in bounds)
                 or list(bounds) != sorted(set(bounds))):
    _fail("stage_boundaries", bounds,
          "() or increasing block indices >= 0, one per stage")


def _check_data(config) -> None:
  if config.dataset not in data_lib.names():
    _fail("dataset", config.dataset, ", ".join(data_lib.names()))
  kwargs = dict(config.dataset_kwargs)
  _check_kwargs("dataset_kwargs", data_lib.PARTS, config.dataset, kwargs,
                {"seed": _NATURAL_INT, "num_train": _POSITIVE_INT,
                 "num_test": _POSITIVE_INT, "in_features": _POSITIVE_INT,
                 "num_classes": _POSITIVE_INT, "seq_len": _POSITIVE_INT})
  if "data_dir" in kwargs:
    path = os.path.expanduser(str(kwargs["data_dir"]))
    if not os.path.isdir(path):
      _fail("dataset_kwargs.data_dir", kwargs["data_dir"],
            f"an existing directory with the {config.dataset} files (nothing "
            "is downloaded)")


def _positive_ints(value: Any) -> bool:
  """Whether every integer in a (nested) value is >= 1."""
  if isinstance(value, (list, tuple)):
    return all(_positive_ints(v) for v in value)
  return not _is_int(value) or value >= 1


def _check_model(config) -> None:
  if config.model not in models.names():
    _fail("model", config.model, ", ".join(models.names()))
  kwargs = dict(config.model_kwargs)
  _check_kwargs("model_kwargs", models.PARTS, config.model, kwargs, {})
  for key, value in kwargs.items():
    if not _positive_ints(value):
      _fail(f"model_kwargs.{key}", value,
            "positive integers (widths, depths and counts are >= 1)")
  if config.loss not in losses.names():
    _fail("loss", config.loss, ", ".join(losses.names()))


def _check_schedule_and_sync(config) -> None:
  if config.schedule not in schedules.names():
    _fail("schedule", config.schedule, ", ".join(schedules.names()))
  _check_kwargs("schedule_kwargs", schedules.PARTS, config.schedule,
                dict(config.schedule_kwargs), SCHEDULE_KWARGS)
  if config.sync not in sync_lib.names():
    _fail("sync", config.sync, ", ".join(sync_lib.names()))
  _check_kwargs("sync_kwargs", sync_lib.PARTS, config.sync,
                dict(config.sync_kwargs), SYNC_KWARGS)


def _check_update_rule(config) -> None:
  valid = optim.names()
  for i, entry in enumerate(config.transforms):
    key = f"transforms[{i}]"
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      _fail(key, entry, "a (name, kwargs) pair")
    name, kwargs = entry
    if name not in valid:
      _fail(f"{key} name", name, ", ".join(valid))
    _check_kwargs(f"{key} {name}", optim.TRANSFORMS, name, dict(kwargs),
                  TRANSFORM_KWARGS)
  names = optimizers.OPTIMIZERS.names()
  if config.optimizer not in names:
    _fail("optimizer", config.optimizer,
          f"an optax optimizer: {', '.join(names)}")
  _check_kwargs("optimizer_kwargs", optimizers.OPTIMIZERS, config.optimizer,
                dict(config.optimizer_kwargs), OPTIMIZER_KWARGS)
  _check_optimizer_parts(config)


def _named_part(key: str, entry: Any, parts: registry.Registry,
                ranges: dict[str, Any]) -> None:
  """An optional `(name, kwargs)` entry against its registry (empty: none)."""
  if not entry:
    return
  if not isinstance(entry, (tuple, list)) or len(entry) != 2:
    _fail(key, entry, "() or a (name, kwargs) pair")
  name, kwargs = entry
  if name not in parts.names():
    _fail(f"{key} name", name, ", ".join(sorted(parts.names())))
  _check_kwargs(f"{key} {name}", parts, name, dict(kwargs), ranges)


def _check_remat(config) -> None:
  if "remat" in config:
    _check_range("remat", config.remat,
                 (lambda v: v in residuals_lib.REMATS,
                  " or ".join(map(repr, residuals_lib.REMATS))))
  if "tick" in config:
    _check_range("tick", config.tick, (lambda v: v in lanes_lib.TICKS,
                                       " or ".join(map(repr, lanes_lib.TICKS))))
  if "stash" in config:
    _check_range("stash", config.stash, (lambda v: v in pool_lib.MODES,
                                         " or ".join(map(repr, pool_lib.MODES))))


def stage_devices(config) -> int:
  """Devices on the mesh's 'stage' axis: `stage_devices`, or by default
  `num_stages` (a device-level schedule: num_stages / num_chunks)."""
  default = config.num_stages
  if config.schedule in schedules.DEVICE_LEVEL:
    default //= config.get("num_chunks", 1)
  return config.get("stage_devices", 0) or default


def _check_placement(config) -> None:
  """`placement` names one, and `stage_devices` fits `num_stages` there
  (building the placement checks it); `num_chunks` (v) divides `num_stages`
  for a device-level schedule, whose placement is its own (checked when the
  pipeline is built, `placement.for_schedule`), and is 1 for the others."""
  name = config.get("placement", "consecutive")
  if name not in placement_lib.names():
    _fail("placement", name, ", ".join(placement_lib.names()))
  chunks = config.get("num_chunks", 1)
  if config.schedule in schedules.DEVICE_LEVEL:
    if config.num_stages % chunks:
      _fail("num_chunks", chunks, f"a divisor of num_stages="
            f"{config.num_stages} (chunks a device holds)")
    return
  if chunks != 1:
    _fail("num_chunks", chunks, f"1 for the stage-level schedule "
          f"{config.schedule!r} (chunks a device holds, for "
          f"{', '.join(schedules.DEVICE_LEVEL)}; fold a stage-level schedule "
          "with stage_devices and placement)")
  devices = stage_devices(config)
  try:
    placement_lib.make(name, config.num_stages, devices)
  except ValueError as e:
    _fail("stage_devices", config.stage_devices,
          f"{str(e).partition('valid: ')[2]} (num_stages={config.num_stages}"
          f", placement={name!r}), or 0 for num_stages")


def _check_fsdp(config) -> None:
  """`fsdp` (devices a stage is sharded over, `pipeline/fsdp.py`) divides
  each data replica's micro-batch, which its members split."""
  F = config.get("fsdp", 1)
  if F > 1 and config.microbatch_size % F:
    _fail("fsdp", F, f"a divisor of microbatch_size={config.microbatch_size} "
          "(each of a stage's fsdp devices takes an equal part of a "
          "micro-batch)")


def _check_optimizer_scope(config) -> None:
  if "optimizer_scope" in config:
    _check_range("optimizer_scope", config.optimizer_scope,
                 (lambda v: v in scope_lib.SCOPES,
                  " or ".join(map(repr, scope_lib.SCOPES))))


def _check_optimizer_parts(config) -> None:
  """Learning-rate schedule, weight decay, clipping and wrapper, when the
  config has them."""
  if "weight_decay" in config:
    _check_range("weight_decay", config.weight_decay, _NON_NEGATIVE)
    _check_range("weight_decay_mode", config.weight_decay_mode,
                 (lambda v: v in optimizers.WEIGHT_DECAY_MODES,
                  " or ".join(map(repr, optimizers.WEIGHT_DECAY_MODES))))
  if "grad_clip_norm" in config:
    _check_range("grad_clip_norm", config.grad_clip_norm, _NON_NEGATIVE)
  if "lr_schedule" in config:
    _named_part("lr_schedule", config.lr_schedule, optimizers.SCHEDULES, {})
  if "optimizer_wrapper" in config:
    _named_part("optimizer_wrapper", config.optimizer_wrapper, optim.WRAPPERS,
                TRANSFORM_KWARGS)


def _check_sizes(node, prefix: str = "") -> None:
  """Every integer fits int64 (a larger one overflows on its way to C)."""
  items = (node.items() if hasattr(node, "items") else
           enumerate(node) if isinstance(node, (list, tuple)) else ())
  for key, value in items:
    name = f"{prefix}.{key}" if prefix and hasattr(node, "items") else (
        f"{prefix}[{key}]" if prefix else str(key))
    if _is_int(value) and not -2**63 <= value < 2**63:
      _fail(name, value, "an integer that fits 64 bits")
    _check_sizes(value, name)


def check(config) -> None:
  """Raises `ValueError`, one line, at the first invalid field of `config`."""
  _check_sizes(config)
  _check_top_level(config)
  _check_data(config)
  _check_model(config)
  _check_schedule_and_sync(config)
  _check_update_rule(config)
  _check_remat(config)
  _check_optimizer_scope(config)
  _check_placement(config)
  _check_fsdp(config)
