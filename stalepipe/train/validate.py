"""Checks a whole run config before anything is created or compiled.

`check(config)` raises `ValueError` with one line naming the key, the value
and what is valid. Which keyword arguments a schedule, sync policy, update
rule, optimizer, model or dataset accepts is read from its registered
factory's signature, so each registry stays the one declaration of its
options; the value ranges are declared here, in one place.

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

import inspect
import math
import os
from typing import Any, Callable

import optax

from stalepipe import models
from stalepipe import optim
from stalepipe import schedules
from stalepipe import sync as sync_lib
from stalepipe.train import input_pipeline
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

TOP_LEVEL = {
    "seed": _NATURAL_INT,
    "num_stages": _POSITIVE_INT,
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
}
SCHEDULE_KWARGS = {"concurrent_minibatches": _POSITIVE_INT,
                   "vertical_sync": _BOOL}
SYNC_KWARGS = {"clock_distance": _NATURAL_INT,
               "concurrent_minibatches": _POSITIVE_INT,
               "history": _POSITIVE_INT, "window": _POSITIVE,
               "enforce": _BOOL, "seed": _NATURAL_INT,
               "period": _POSITIVE_INT,
               "server": (lambda v: v in ("sum", "mean"), "'sum' or 'mean'")}
TRANSFORM_KWARGS = {
    "delay": _NATURAL_INT, "lam": _NON_NEGATIVE,
    "form": (lambda v: v in ("diagonal", "full"), "'diagonal' or 'full'"),
    "adaptive": (lambda v: v in (None, "ema", "current"),
                 "None, 'ema' or 'current'"),
    "eps": _POSITIVE, "decay": _FRACTION, "b1": _FRACTION, "b2": _FRACTION,
    "num_workers": _POSITIVE_INT, "wave_size": _POSITIVE_INT,
    "staleness": _NON_NEGATIVE, "option": (lambda v: v in (1, 2, 3), "1, 2 or 3"),
    "warmup_steps": _NATURAL_INT,
}


def _if_number(rule):
  """`rule` for numbers; other values (a schedule given by name) pass."""
  test, valid = rule
  return (lambda v: not isinstance(v, (int, float)) or test(v), valid)


OPTIMIZER_KWARGS = {k: _if_number(r) for k, r in {
    "learning_rate": _POSITIVE, "momentum": _FRACTION, "b1": _FRACTION,
    "b2": _FRACTION, "eps": _POSITIVE, "weight_decay": _NON_NEGATIVE}.items()}
# Arguments the trainer fills in itself, so a config may leave them out.
_FILLED_IN = {
    "model": {"in_features", "num_classes", "vocab_size", "max_len",
              "in_channels", "image_size", "seed"},
    "schedule": {"num_stages", "num_microbatches", "num_minibatches"},
    "sync": {"num_replicas", "concurrent_minibatches"},
    "transform": {"num_workers"},
    "dataset": {"process_index", "process_count"},
}


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


def _check_kwargs(prefix: str, owner: str, factory: Callable,
                  kwargs: dict[str, Any], ranges: dict[str, Any],
                  filled: set[str]) -> None:
  """Keys against `factory`'s signature, required ones present, ranges."""
  params = inspect.signature(factory).parameters
  accepted = [p for p in params if p not in filled
              and params[p].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                         inspect.Parameter.VAR_KEYWORD)]
  takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD
                  for p in params.values())
  for key, value in kwargs.items():
    if key not in params and not takes_any:
      raise ValueError(f"{prefix}.{key}={value!r} is invalid: {owner} takes "
                       f"no {key!r}; valid keys: "
                       f"{', '.join(accepted) or 'none'}")
    if key in ranges:
      _check_range(f"{prefix}.{key}", value, ranges[key])
  for name in accepted:
    if (params[name].default is inspect.Parameter.empty
        and name not in kwargs):
      valid = ranges[name][1] if name in ranges else "a value"
      raise ValueError(f"{prefix}.{name} is missing: {owner} needs it; "
                       f"valid: {valid}")


def optimizer_names() -> list[str]:
  """optax's optimizers: its public factories that take a learning rate."""
  names = []
  for name in dir(optax):
    factory = getattr(optax, name)
    if (name.startswith(("_", "scale_by"))
        or not inspect.isfunction(factory)):
      continue
    try:
      if "learning_rate" in inspect.signature(factory).parameters:
        names.append(name)
    except (TypeError, ValueError):
      continue
  return sorted(names)


def transform_names() -> list[str]:
  """stalepipe.optim's transform factories (lowercase public functions)."""
  return sorted(n for n in optim.__all__ if n.islower()
                and inspect.isfunction(getattr(optim, n))
                and n not in ("compensate", "minimal_stale_prefix",
                              "spectrain_prediction", "wave_complete"))


def _factories(field: str) -> tuple[dict[str, Callable], str]:
  """The registry a `<part>_kwargs` field's keys are read from, and `part`."""
  part = field[:-len("_kwargs")]
  registry = {
      "schedule": schedules._REGISTRY,  # pylint: disable=protected-access
      "sync": sync_lib._REGISTRY,  # pylint: disable=protected-access
      "model": models._REGISTRY,  # pylint: disable=protected-access
      "dataset": input_pipeline.DATASETS,
  }.get(part)
  if part == "optimizer":
    registry = {n: getattr(optax, n) for n in optimizer_names()}
  return registry or {}, part


def accepted_keys(field: str, name: str) -> list[str] | None:
  """The keys `field` (e.g. "schedule_kwargs") takes for the part `name`.

  None where `field` is not such a field or `name` is not registered.
  """
  registry, part = _factories(field)
  if name not in registry:
    return None
  params = inspect.signature(registry[name]).parameters
  return [p for p in params if p not in _FILLED_IN.get(part, ())
          and params[p].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                     inspect.Parameter.VAR_KEYWORD)]


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
  if config.dataset not in input_pipeline.DATASETS:
    _fail("dataset", config.dataset, ", ".join(input_pipeline.DATASETS))
  kwargs = dict(config.dataset_kwargs)
  _check_kwargs("dataset_kwargs", f"dataset {config.dataset!r}",
                input_pipeline.DATASETS[config.dataset], kwargs,
                {"seed": _NATURAL_INT, "num_train": _POSITIVE_INT,
                 "num_test": _POSITIVE_INT, "in_features": _POSITIVE_INT,
                 "num_classes": _POSITIVE_INT, "seq_len": _POSITIVE_INT},
                _FILLED_IN["dataset"])
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
  from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
  if config.model not in models.names():
    _fail("model", config.model, ", ".join(models.names()))
  kwargs = dict(config.model_kwargs)
  _check_kwargs("model_kwargs", f"model {config.model!r}",
                models._REGISTRY[config.model],  # pylint: disable=protected-access
                kwargs, {}, _FILLED_IN["model"])
  for key, value in kwargs.items():
    if not _positive_ints(value):
      _fail(f"model_kwargs.{key}", value,
            "positive integers (widths, depths and counts are >= 1)")
  if config.loss not in trainer.LOSSES:
    _fail("loss", config.loss, ", ".join(trainer.LOSSES))


def _check_schedule_and_sync(config) -> None:
  if config.schedule not in schedules.names():
    _fail("schedule", config.schedule, ", ".join(schedules.names()))
  _check_kwargs("schedule_kwargs", f"schedule {config.schedule!r}",
                schedules._REGISTRY[config.schedule],  # pylint: disable=protected-access
                dict(config.schedule_kwargs), SCHEDULE_KWARGS,
                _FILLED_IN["schedule"])
  if config.sync not in sync_lib.names():
    _fail("sync", config.sync, ", ".join(sync_lib.names()))
  _check_kwargs("sync_kwargs", f"sync policy {config.sync!r}",
                sync_lib._REGISTRY[config.sync],  # pylint: disable=protected-access
                dict(config.sync_kwargs), SYNC_KWARGS, _FILLED_IN["sync"])


def _check_update_rule(config) -> None:
  valid = transform_names()
  for i, entry in enumerate(config.transforms):
    key = f"transforms[{i}]"
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      _fail(key, entry, "a (name, kwargs) pair")
    name, kwargs = entry
    if name not in valid:
      _fail(f"{key} name", name, ", ".join(valid))
    _check_kwargs(f"{key} {name}", f"transform {name!r}",
                  getattr(optim, name), dict(kwargs), TRANSFORM_KWARGS,
                  _FILLED_IN["transform"])
  names = optimizer_names()
  if config.optimizer not in names:
    _fail("optimizer", config.optimizer,
          f"an optax optimizer: {', '.join(names)}")
  _check_kwargs("optimizer_kwargs", f"optax.{config.optimizer}",
                getattr(optax, config.optimizer),
                dict(config.optimizer_kwargs),
                OPTIMIZER_KWARGS, set())
  _check_optimizer_parts(config)


def _named_part(key: str, entry: Any, registry: dict[str, Callable],
                what: str, ranges: dict[str, Any], filled: set[str]) -> None:
  """An optional `(name, kwargs)` entry against its registry (empty: none)."""
  if not entry:
    return
  if not isinstance(entry, (tuple, list)) or len(entry) != 2:
    _fail(key, entry, "() or a (name, kwargs) pair")
  name, kwargs = entry
  if name not in registry:
    _fail(f"{key} name", name, ", ".join(sorted(registry)))
  _check_kwargs(f"{key} {name}", f"{what} {name!r}", registry[name],
                dict(kwargs), ranges, filled)


def _check_remat(config) -> None:
  if "remat" in config:
    _check_range("remat", config.remat,
                 (lambda v: v in residuals_lib.REMATS,
                  " or ".join(map(repr, residuals_lib.REMATS))))


def _check_optimizer_scope(config) -> None:
  if "optimizer_scope" in config:
    _check_range("optimizer_scope", config.optimizer_scope,
                 (lambda v: v in scope_lib.SCOPES,
                  " or ".join(map(repr, scope_lib.SCOPES))))


def _check_optimizer_parts(config) -> None:
  """Learning-rate schedule, weight decay, clipping and wrapper (issue 14's
  fields), when the config has them."""
  if "weight_decay" in config:
    _check_range("weight_decay", config.weight_decay, _NON_NEGATIVE)
    _check_range("weight_decay_mode", config.weight_decay_mode,
                 (lambda v: v in optimizers.WEIGHT_DECAY_MODES,
                  " or ".join(map(repr, optimizers.WEIGHT_DECAY_MODES))))
  if "grad_clip_norm" in config:
    _check_range("grad_clip_norm", config.grad_clip_norm, _NON_NEGATIVE)
  if "lr_schedule" in config:
    _named_part("lr_schedule", config.lr_schedule, optimizers.SCHEDULES,
                "schedule", {}, set())
  if "optimizer_wrapper" in config:
    _named_part("optimizer_wrapper", config.optimizer_wrapper,
                optimizers.WRAPPERS, "wrapper", TRANSFORM_KWARGS,
                {"optimizer"} | _FILLED_IN["transform"])


def check(config) -> None:
  """Raises `ValueError`, one line, at the first invalid field of `config`."""
  _check_top_level(config)
  _check_data(config)
  _check_model(config)
  _check_schedule_and_sync(config)
  _check_update_rule(config)
  _check_remat(config)
  _check_optimizer_scope(config)
