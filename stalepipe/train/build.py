"""A config's parts, each built by name: checking a config is building it.

`parts(config)` runs `validate.check` (the value ranges and the checks that
span fields), then builds every part the config names through its plane's
`make`: the data shards this process reads, the model's blocks and stages,
the loss, the schedule, the sync policy, the update rule, the mesh and the
`Pipeline`. Nothing is compiled and no step runs; whatever a part's factory
refuses is refused here, in one line, before a run writes anything. The
trainer runs the `Parts` it is given, so what the check accepts is what runs.

Examples:
  >>> import sys; sys.path.insert(0, ".")
  >>> from configs import default
  >>> run = parts(default.get_config())
  >>> run.schedule.name, len(run.staged.stage_fns), run.window_shape
  ('gpipe', 4, (4, 4, 2, 8))
"""

import importlib
import inspect
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import ml_collections
import numpy as np

from stalepipe import models
from stalepipe import schedules
from stalepipe import sync as sync_lib
from stalepipe.models import losses
from stalepipe.pipeline import executor
from stalepipe.schedules import Schedule
from stalepipe.train import input_pipeline
from stalepipe.train import optimizers
from stalepipe.train import validate


class Parts(NamedTuple):
  """Everything a run needs, built from its config."""

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  shards: Sequence[input_pipeline.Shard]  # this process's data replicas
  test: tuple[np.ndarray, np.ndarray]  # (x_test, y_test)
  staged: models.Staged
  loss_fn: Callable[..., Any]
  schedule: Schedule
  pipeline: executor.Pipeline
  # `(factory, kwargs)` of the config's own hooks (`config.hooks`); the
  # trainer calls `factory(parts, workdir, **kwargs)` for each.
  hooks: Sequence[tuple[Callable[..., Any], dict[str, Any]]] = ()

  @property
  def steps_per_window(self) -> int:
    """B: minibatches (steps) in one jitted pipeline step."""
    return self.config.minibatches_per_window

  @property
  def examples_per_step(self) -> int:
    """M * D * b: the examples of one minibatch over all data replicas."""
    c = self.config
    return c.num_microbatches * c.num_replicas * c.microbatch_size

  @property
  def window_shape(self) -> tuple[int, ...]:
    """[B, M, D, b]: the leading dimensions of a window's inputs."""
    c = self.config
    return (c.minibatches_per_window, c.num_microbatches, c.num_replicas,
            c.microbatch_size)

  def batch(self, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Window `window`'s (inputs, targets), rows [B, M, D, b, ...]."""
    c = self.config
    return input_pipeline.window_batch(
        self.shards, window, c.minibatches_per_window, c.num_microbatches,
        c.microbatch_size, c.seed)


def make_mesh(num_replicas: int, num_stages: int,
              fsdp: int = 1) -> jax.sharding.Mesh:
  """A ('data', 'stage') mesh over the first D * S devices of all processes
  (`num_stages`: the devices on 'stage', `stage_devices` where folded); with
  `fsdp` > 1 a ('data', 'stage', 'fsdp') mesh of D * S * F devices, each
  stage sharded over F (`pipeline/fsdp.py`)."""
  devices = jax.devices()
  need = num_replicas * num_stages * fsdp
  if need > len(devices):
    product = f"{num_replicas} x {num_stages}" + (
        f" x {fsdp}" if fsdp > 1 else "")
    raise ValueError(
        f"mesh num_replicas x stage devices{' x fsdp' if fsdp > 1 else ''} = "
        f"{product} = {need} devices does not fit the {len(devices)} "
        f"{devices[0].platform.upper()} devices here; valid: at most "
        f"{len(devices)}")
  if jax.process_count() > 1 and need != len(devices):
    raise ValueError(
        f"mesh num_replicas x stage devices = {need} devices leaves some of the "
        f"{jax.process_count()} processes without a device; valid: exactly "
        f"{len(devices)} (all devices of all processes)")
  if fsdp > 1:
    return jax.make_mesh((num_replicas, num_stages, fsdp),
                         (executor.DATA, executor.STAGE, executor.FSDP),
                         devices=devices[:need])
  return jax.make_mesh((num_replicas, num_stages),
                       (executor.DATA, executor.STAGE), devices=devices[:need])


def _shards(config, mesh) -> tuple[list[input_pipeline.Shard], Any]:
  """The data replicas whose devices this process holds, and one dataset."""
  D = config.num_replicas
  local = [r for r in range(D) if any(
      d.process_index == jax.process_index() for d in mesh.devices[r].flat)]
  shards, ds = [], None
  for r in local:
    ds = input_pipeline.load(config.dataset, dict(config.dataset_kwargs), r, D,
                             config.input_shape)
    shards.append(input_pipeline.Shard(r, ds.x_train, ds.y_train))
  return shards, ds


def _check_window(config, shards) -> None:
  """A window's rows fit each shard and its arrays fit the host's memory:
  arithmetic, so a window far too large is refused at once."""
  c = config
  need = c.minibatches_per_window * c.num_microbatches * c.microbatch_size
  for shard in shards:
    if need > len(shard.x):
      raise ValueError(
          f"minibatches_per_window x num_microbatches x microbatch_size = "
          f"{c.minibatches_per_window} x {c.num_microbatches} x "
          f"{c.microbatch_size} = {need} examples per window, but a data "
          f"replica's shard has {len(shard.x)}; valid: at most {len(shard.x)}")
    row_bytes = shard.x[0].nbytes + shard.y[0].nbytes
    window_bytes = need * len(shards) * row_bytes
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if window_bytes > memory // 4:
      raise ValueError(
          f"a window's inputs take {window_bytes / 2**30:.1f} GiB, more than "
          f"a quarter of this host's {memory / 2**30:.1f} GiB; valid: fewer "
          "minibatches_per_window, num_microbatches or microbatch_size")


def _sync(config, schedule: Schedule) -> sync_lib.SyncPolicy:
  kwargs = dict(config.sync_kwargs)
  if config.sync == "wsp":  # a wave is the schedule's N_m minibatches
    kwargs.setdefault("concurrent_minibatches",
                      schedule.options.get("concurrent_minibatches", 1))
  return sync_lib.make(config.sync, num_replicas=config.num_replicas,
                       schedule=schedule, num_steps=config.num_steps, **kwargs)


def _hook_factories(config) -> list[tuple[Callable[..., Any], dict[str, Any]]]:
  """`config.hooks`: `("module:factory", kwargs)` pairs, imported and checked.

  A factory is called as `factory(parts, workdir, **kwargs)` and returns a
  hook (`stalepipe.train.loop`), e.g. `("experiments.hooks:StageNorms",
  {"every": 100})`.
  """
  found = []
  for i, entry in enumerate(config.get("hooks", ())):
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      raise ValueError(f"hooks[{i}]={entry!r} is invalid; valid: a "
                       "('module:factory', kwargs) pair")
    where, kwargs = entry
    if not isinstance(kwargs, Mapping):
      raise ValueError(f"hooks[{i}] {where} kwargs {kwargs!r} are invalid; "
                       "valid: a dict of the factory's keyword arguments")
    kwargs = dict(kwargs)
    module, _, attr = str(where).partition(":")
    try:
      factory = getattr(importlib.import_module(module), attr)
    except Exception as e:  # pylint: disable=broad-except
      # Whatever importing the module raised (a syntax error in it too).
      raise ValueError(f"hooks[{i}] {where!r} is invalid: "
                       f"{type(e).__name__}: {e}; valid: "
                       "'package.module:factory', importable from the "
                       "working directory") from None
    try:
      inspect.signature(factory).bind(None, None, **kwargs)
    except TypeError as e:
      raise ValueError(f"hooks[{i}] {where} kwargs {kwargs} are invalid: "
                       f"{e}; valid: factory(parts, workdir, **kwargs)"
                       ) from None
    found.append((factory, kwargs))
  return found


def _schedule(config) -> Schedule:
  """The config's schedule; a device-level one on num_stages / num_chunks
  devices, holding num_chunks chunks each."""
  kwargs, S = dict(config.schedule_kwargs), config.num_stages
  chunks = config.get("num_chunks", 1)
  if schedules.takes_num_devices(config.schedule):
    kwargs["num_devices"] = S // chunks
  schedule = schedules.make(
      config.schedule, num_stages=S, num_microbatches=config.num_microbatches,
      num_minibatches=config.minibatches_per_window, **kwargs)
  if schedule.placement and S // schedule.num_devices != chunks:
    raise ValueError(f"num_chunks={chunks} is invalid for {config.schedule!r} "
                     f"with num_stages={S}; valid: "
                     f"{S // schedule.num_devices} (its {schedule.placement}"
                     " placement's chunks a device)")
  return schedule


def _check_state_memory(config, pipeline: executor.Pipeline,
                        stage_params) -> None:
  """The state a device holds (weights and every stashed version,
  optimizer state, accumulator: `Pipeline.state_bytes`) fits
  `device_memory_mib` (0: no limit): arithmetic on the layouts, so a run
  that would not fit is refused before it places anything."""
  limit = config.get("device_memory_mib", 0)
  if not limit:
    return
  need = pipeline.state_bytes(stage_params)
  if need["total"] > limit * 2**20:
    mib = {k: v / 2**20 for k, v in need.items()}
    raise ValueError(
        f"the state takes {mib['total']:.2f} MiB a device (weights and their "
        f"stash {mib['weights']:.2f}, optimizer state {mib['optimizer']:.2f}, "
        f"accumulator {mib['accumulator']:.2f}), over device_memory_mib="
        f"{limit}; valid: a larger fsdp (each stage sharded over more "
        f"devices; now {config.get('fsdp', 1)}), more stage_devices, or "
        f"device_memory_mib >= {mib['total']:.2f}")


def parts(config: ml_collections.ConfigDict) -> Parts:
  """Checks `config` by building every part it names; one line if one fails.

  Raises:
    ValueError: naming the field, the value and what is valid.
  """
  validate.check(config)
  D, S = config.num_replicas, config.num_stages
  mesh = make_mesh(D, validate.stage_devices(config), config.get("fsdp", 1))
  shards, ds = _shards(config, mesh)
  _check_window(config, shards)  # before the schedule and the pipeline
  blocks = models.make(config.model, seed=config.seed, **config.model_kwargs,
                       **models.data_kwargs(config.model, ds.x_test[0],
                                            ds.num_classes))
  staged = models.split(blocks, tuple(config.stage_boundaries) or S)
  if len(staged.stage_fns) != S:
    raise ValueError(f"stage_boundaries {config.stage_boundaries} give "
                     f"{len(staged.stage_fns)} stages; valid: "
                     f"num_stages={S} boundaries")
  schedule = _schedule(config)
  loss_fn = losses.make(config.loss)
  pipeline = executor.Pipeline(
      staged.stage_fns, loss_fn, schedule,
      optimizers.from_config(config, num_replicas=D), mesh,
      sync=_sync(config, schedule), remat=config.get("remat", "recompute"),
      optimizer_scope=config.get("optimizer_scope", "auto"),
      tick=config.get("tick", "auto"), stash=config.get("stash", "slots"),
      placement=config.get("placement", "consecutive"))  # a device-level
  #   schedule refuses any but its own (`placement.for_schedule`)
  _check_state_memory(config, pipeline, staged.stage_params)
  run = Parts(config, mesh, shards, (ds.x_test, ds.y_test), staged, loss_fn,
              schedule, pipeline, _hook_factories(config))
  run.batch(0)  # a window that does not fit the data fails here
  return run
