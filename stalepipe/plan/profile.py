"""Per-block profiles: time and memory of each block of a model (seed 001 §7).

HetPipe's partitioner works from a profile of the model: the computation time
of every layer on each GPU type, and the memory each layer needs, measured on
one type "as it is roughly the same for all GPU types" (seed 001 §7). A
`Profile` is that table as plain data; `measure` fills it for a list of NNX
blocks on the current JAX device, `scale` carries it to another device type
by the ratio of peak throughputs, and `save` / `load` keep it as JSON.
"""

import dataclasses
import json
import statistics
import time
from typing import Sequence

import jax
from flax import nnx

from stalepipe.models import staging
from stalepipe.plan.devices import DeviceType


@dataclasses.dataclass(frozen=True)
class Profile:
  """Time and memory of each block of a model for one minibatch.

  Attributes:
    device: name of the device type the times belong to.
    batch_size: minibatch size the profile was taken at.
    forward_s: forward seconds per block.
    backward_s: backward seconds per block.
    param_bytes: parameter bytes per block.
    output_bytes: bytes of each block's output activation (what the next
      stage receives forward, and sends back as a gradient).
    kept_bytes: bytes each block keeps from forward to backward, beyond its
      parameters (its residuals: inputs and intermediate activations).
  """

  device: str
  batch_size: int
  forward_s: tuple[float, ...]
  backward_s: tuple[float, ...]
  param_bytes: tuple[int, ...]
  output_bytes: tuple[int, ...]
  kept_bytes: tuple[int, ...]

  def __post_init__(self):
    fields = ("forward_s", "backward_s", "param_bytes", "output_bytes",
              "kept_bytes")
    lengths = {f: len(getattr(self, f)) for f in fields}
    if len(set(lengths.values())) != 1 or not lengths["forward_s"]:
      raise ValueError(f"profile columns have lengths {lengths}; valid: one "
                       "equal length of at least 1")
    for f in fields:
      if min(getattr(self, f)) < 0:
        raise ValueError(f"profile column {f} has a negative entry "
                         f"{min(getattr(self, f))}; valid: >= 0")

  @property
  def num_blocks(self) -> int:
    return len(self.forward_s)


def _median_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _nbytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _residual_param_bytes(fn, params, x) -> int:
  """Bytes of the residuals of `jax.vjp(fn, params, x)` that are parameters."""
  jaxpr = jax.make_jaxpr(lambda p, h: jax.vjp(fn, p, h)[1])(params, x).jaxpr
  param_vars = set(jaxpr.invars[:len(jax.tree.leaves(params))])
  forwarded = {v for v in jaxpr.outvars if v in param_vars}
  return sum(v.aval.size * v.aval.dtype.itemsize for v in forwarded)


def measure(blocks: Sequence[nnx.Module], x: jax.Array, *,
            device: str | None = None, repeats: int = 5) -> Profile:
  """Profiles each block of a model on the current default JAX device.

  Forward and backward times are medians of `repeats` jitted calls. The bytes
  kept for backward are the residuals of `jax.vjp` as the compiled program
  holds them (`memory_analysis().output_size_in_bytes`), less the residuals
  that are the block's own parameters, which a stage holds anyway.

  Args:
    blocks: the model, NNX modules applied in order (`stalepipe.models`).
    x: one minibatch of model input.
    device: name for the device type; defaults to JAX's `device_kind`.
    repeats: timed calls per block and pass.

  Returns:
    The profile at batch size `x.shape[0]`.

  References:
    Park et al, HetPipe <https://www.usenix.org/conference/atc20/presentation/park>,
    2020, §7 (profiling each layer's time and memory).

  Examples:
    >>> import jax.numpy as jnp
    >>> from stalepipe.models import mlp
    >>> p = measure(mlp(8, 16, 2, 4), jnp.ones((4, 8)), repeats=1)
    >>> p.num_blocks, p.output_bytes
    (3, (256, 256, 64))
  """
  if repeats < 1:
    raise ValueError(f"repeats={repeats} is invalid; valid: >= 1")
  staged = staging.split(blocks, tuple(range(len(blocks))))
  columns = {"forward_s": [], "backward_s": [], "param_bytes": [],
             "output_bytes": [], "kept_bytes": []}
  for fn, params in zip(staged.stage_fns, staged.stage_params):
    forward = jax.jit(fn)
    residuals = jax.jit(lambda p, h, fn=fn: jax.vjp(fn, p, h)[1])
    backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
    y = forward(params, x)
    vjp_fn = residuals(params, x)
    held = residuals.lower(params, x).compile().memory_analysis()
    columns["forward_s"].append(_median_seconds(forward, params, x,
                                                repeats=repeats))
    columns["backward_s"].append(_median_seconds(backward, vjp_fn, y,
                                                 repeats=repeats))
    columns["param_bytes"].append(_nbytes(params))
    columns["output_bytes"].append(_nbytes(y))
    columns["kept_bytes"].append(int(held.output_size_in_bytes)
                                 - _residual_param_bytes(fn, params, x))
    x = y
  name = device or jax.devices()[0].device_kind
  return Profile(device=name, batch_size=int(x.shape[0]),
                 **{k: tuple(v) for k, v in columns.items()})


def scale(profile: Profile, source: DeviceType, target: DeviceType) -> Profile:
  """Carries a profile taken on `source` to `target` by peak throughput.

  .. math::
    t_{target} = t_{source} \\cdot \\mathrm{TFLOPS}_{source} /
    \\mathrm{TFLOPS}_{target}

  Memory columns are unchanged (seed 001 §7 measures memory on one type).

  Args:
    profile: a profile whose times were taken on `source`.
    source: the device type the profile was taken on.
    target: the device type to estimate times for.

  Returns:
    The profile with times scaled and `device` set to `target.name`.

  References:
    Park et al, HetPipe, 2020, §7 and Table 1.

  Examples:
    >>> from stalepipe.plan.devices import TITAN_V, QUADRO_P4000
    >>> p = Profile("V", 32, (1.0,), (2.0,), (4,), (4,), (4,))
    >>> round(scale(p, TITAN_V, QUADRO_P4000).forward_s[0], 3)
    2.809
  """
  if profile.device != source.name:
    raise ValueError(f"profile was taken on {profile.device!r}, not on "
                     f"source {source.name!r}; valid: the profile's device")
  ratio = source.tflops / target.tflops
  return dataclasses.replace(
      profile, device=target.name,
      forward_s=tuple(t * ratio for t in profile.forward_s),
      backward_s=tuple(t * ratio for t in profile.backward_s))


def save(profile: Profile, path: str) -> None:
  """Writes `profile` as JSON to `path`."""
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(profile), f, indent=1)


def load(path: str) -> Profile:
  """Reads a profile written by `save`."""
  with open(path) as f:
    data = json.load(f)
  return Profile(**{k: tuple(v) if isinstance(v, list) else v
                    for k, v in data.items()})
