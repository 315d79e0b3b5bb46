"""Slowdowns injected into a simulated cluster: random stragglers and traces.

Both produce, for every iteration (minibatch) and worker (one stage of one
pipeline), an added delay in seconds and a multiplier on compute time. The
simulator spends the delay as a sleep at the start of the worker's iteration
(seed 002 §5.1: "injecting sleep commands into workers") and multiplies the
iteration's forward and backward durations by the multiplier.

Workers are numbered pipeline-major: worker `i * S + s` is stage `s` of
pipeline `i`.
"""

import dataclasses
import json
import os

import numpy as np

# Seed 002 §5.1: each worker independently, with probability 10% per
# iteration, sleeps 0.1 s (ResNet) / 0.2 s (BERT) in hete-A and 0.3 s / 0.6 s
# in hete-B.
_HETE = {("A", "resnet"): 0.1, ("A", "bert"): 0.2,
         ("B", "resnet"): 0.3, ("B", "bert"): 0.6}


@dataclasses.dataclass(frozen=True)
class Stragglers:
  """Each worker sleeps `delay` s with probability `probability` per iteration.

  Draws are independent across workers and iterations (seed 002 §5.1).

  Attributes:
    probability: chance of a delay per worker and iteration, in [0, 1].
    delay: seconds added when it happens.
  """

  probability: float
  delay: float

  def __post_init__(self):
    if not 0 <= self.probability <= 1:
      raise ValueError(f"probability={self.probability!r} is invalid; it must "
                       "be in [0, 1]")
    if not self.delay >= 0:
      raise ValueError(f"delay={self.delay!r} is invalid; it must be >= 0")

  def sample(self, shape: tuple[int, int, int], rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray]:
    """`(delay, multiplier)`, each `[iterations, pipelines, stages]` (the
    constant one read-only)."""
    hit = rng.random(shape) < self.probability
    return hit * self.delay, np.broadcast_to(1.0, shape)


def hete(setting: str, model: str = "resnet") -> Stragglers:
  """SDPipe's hete-A / hete-B (seed 002 §5.1) for "resnet" or "bert".

  Examples:
    >>> hete("B")
    Stragglers(probability=0.1, delay=0.3)
  """
  key = (setting, model)
  if key not in _HETE:
    raise ValueError(f"hete setting {setting!r}/{model!r} is invalid; valid: "
                     f"{sorted(_HETE)}")
  return Stragglers(probability=0.1, delay=_HETE[key])


@dataclasses.dataclass(frozen=True)
class Trace:
  """A recorded slowdown, `values[iteration, worker]`, replayed cyclically.

  Seed 002 §5.5 records each cloud GPU's FLOPS normalised by its peak and
  replays it on dedicated GPUs as extra overhead; `kind="multiplier"` replays
  such a record as the factor compute time is multiplied by (1/normalised
  FLOPS), `kind="delay"` as seconds added per iteration.

  Attributes:
    values: `[iterations, workers]`, workers numbered pipeline-major.
    kind: "multiplier" or "delay".
  """

  values: np.ndarray
  kind: str = "multiplier"

  def __post_init__(self):
    values = np.asarray(self.values, dtype=float)
    if values.ndim != 2 or 0 in values.shape:
      raise ValueError(f"trace of shape {values.shape} is invalid; it must be "
                       "a non-empty [iterations, workers] array")
    if self.kind not in ("multiplier", "delay"):
      raise ValueError(f"kind={self.kind!r} is invalid; valid: multiplier, "
                       "delay")
    if self.kind == "multiplier" and not (values > 0).all():
      raise ValueError("multiplier trace values must be > 0")
    if self.kind == "delay" and not (values >= 0).all():
      raise ValueError("delay trace values must be >= 0")
    object.__setattr__(self, "values", values)

  def sample(self, shape: tuple[int, int, int], rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray]:
    del rng
    iterations, pipelines, stages = shape
    if self.values.shape[1] != pipelines * stages:
      raise ValueError(f"trace has {self.values.shape[1]} workers; the cluster "
                       f"has {pipelines * stages}")
    rows = np.arange(iterations) % self.values.shape[0]
    grid = self.values[rows].reshape(shape)
    if self.kind == "delay":
      return grid, np.broadcast_to(1.0, shape)
    return np.broadcast_to(0.0, shape), grid


def load_trace(path: str, kind: str = "multiplier") -> Trace:
  """Reads a `[iterations, workers]` trace from a `.npy` or `.json` file.

  Examples:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
    >>> with open(path, "w") as f:
    ...   f.write("[[1.0, 2.0]]")
    12
    >>> load_trace(path).values.tolist()
    [[1.0, 2.0]]
  """
  ext = os.path.splitext(path)[1]
  if ext == ".npy":
    values = np.load(path)
  elif ext == ".json":
    with open(path) as f:
      values = np.asarray(json.load(f), dtype=float)
  else:
    raise ValueError(f"trace file {path!r} is invalid; it must end in .npy or "
                     ".json")
  return Trace(values, kind)


def slowdowns(perturbations, shape: tuple[int, int, int],
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Combines perturbations: delays add, multipliers multiply.

  A constant part (no delay, or no multiplier) stays a read-only broadcast.

  Examples:
    >>> d, m = slowdowns([Stragglers(1.0, 0.5), Stragglers(1.0, 0.25)],
    ...                  (1, 1, 2), np.random.default_rng(0))
    >>> d.tolist(), m.tolist()
    ([[[0.75, 0.75]]], [[[1.0, 1.0]]])
  """
  delay, multiplier = np.broadcast_to(0.0, shape), np.broadcast_to(1.0, shape)
  for k, perturbation in enumerate(perturbations):
    d, m = perturbation.sample(shape, rng)
    delay, multiplier = (d, m) if k == 0 else (delay + d, multiplier * m)
  return delay, multiplier
