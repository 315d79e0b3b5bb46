r"""HetPipe's Wave Synchronous Parallel, time side (seed 001 §5, seed 000).

A *wave* is :math:`N_m` consecutive minibatches of a virtual worker (one
pipeline); the local staleness is :math:`s_{local} = N_m - 1`. At the end of
wave :math:`c` (its last minibatch's update applied on a stage) the worker
pushes the wave's aggregated update of that stage to the stage's parameter
server shard; global wave :math:`c` is complete once every worker has pushed
it, and every worker then pulls it. With clock distance :math:`D`, minibatch
:math:`q` (0-based) may only start once it can read all global updates of
minibatches :math:`0 .. q - s_{global} - 1`,

.. math::

  s_{global} = (D + 1)(s_{local} + 1) + s_{local} - 1,

that is, global waves :math:`0 .. \lfloor (q+1)/N_m \rfloor - D - 2`
(seed 001 §5: with :math:`D = 0, N_m = 4`, minibatch 8 (1-based) waits for
wave 0, minibatch 12 for wave 1). A worker's local clock reaches
:math:`c + 1` once it has pushed wave :math:`c` and pulled global wave
:math:`c - D`, so the clock distance between the fastest and the slowest
worker never exceeds :math:`D`.
"""

import dataclasses

import numpy as np

from stalepipe.sim import policy


def required_wave(minibatch: int, concurrent_minibatches: int,
                  clock_distance: int) -> int:
  r"""The last global wave minibatch `minibatch` (0-based) reads; -1 if none.

  .. math:: \lfloor (q+1)/N_m \rfloor - D - 2

  Equivalently the wave holding minibatch :math:`q - s_{global} - 1`.

  References:
    Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §5

  Examples:
    >>> [required_wave(q, 4, 0) for q in (6, 7, 10, 11)]
    [-1, 0, 0, 1]
  """
  return max(-1, (minibatch + 1) // concurrent_minibatches
             - clock_distance - 2)


class _WSPRunner(policy.Runner):
  gates = True
  floors = True

  def __init__(self, ctx, clock_distance, wave):
    super().__init__(ctx)
    self.D, self.wave = clock_distance, wave
    N, S = ctx.num_pipelines, ctx.cluster.num_stages
    waves = ctx.num_minibatches // wave
    self.visible = np.full((S, waves), np.inf)  # global wave in place, all
    self.pushed = np.full((N, waves, S), np.inf)

  def sync(self, stage, minibatch, ready):
    if (minibatch + 1) % self.wave:
      return policy.SyncOutcome(applied=ready)
    c = minibatch // self.wave
    service = self.ctx.ps_seconds(stage)
    pushed = self.ctx.ps_transfer(stage, ready)
    pulled = self.ctx.ps_transfer(stage, np.full(len(ready), pushed.max()))
    previous = self.visible[stage, c - 1] if c else -np.inf
    self.visible[stage, c] = max(pulled.max(), previous)
    self.pushed[:, c, stage] = pushed
    everyone = np.arange(len(ready))
    return policy.SyncOutcome(
        applied=ready,
        comm=(policy.CommEvent(everyone, pushed - service, pushed),
              policy.CommEvent(everyone, pulled - service, pulled)))

  def gate(self, stage, minibatch):
    w = required_wave(minibatch, self.wave, self.D)
    if w < 0:
      return -np.inf
    if w >= self.visible.shape[1] or np.isinf(self.visible[stage, w]):
      raise ValueError(
          f"minibatch {minibatch} starts on stage {stage} before that stage "
          f"pushed wave {w}; clock_distance={self.D} is too small for this "
          "schedule (raise it or use a schedule with less staleness)")
    return self.visible[stage, w]

  def floor(self, stage, starts):
    waves = np.searchsorted(self.visible[stage], starts, side="right")
    return waves * self.wave

  def clock_times(self) -> np.ndarray:
    """`[pipelines, waves]`: when each worker's local clock reaches `c + 1`."""
    pushed = self.pushed.max(axis=2)
    pulled = np.full(pushed.shape[1], -np.inf)
    if self.D < pushed.shape[1]:
      pulled[self.D:] = self.visible.max(axis=0)[:pushed.shape[1] - self.D]
    return np.maximum(pushed, pulled[None])

  def extras(self):
    return {"wsp_clock_times": self.clock_times(),
            "wsp_global_visible": self.visible}


@dataclasses.dataclass(frozen=True)
class WSP:
  """Wave Synchronous Parallel with clock distance `clock_distance` (D).

  Attributes:
    clock_distance: D >= 0, how many waves the fastest worker may run ahead.
    concurrent_minibatches: N_m, minibatches per wave (HetPipe's schedule
      option of the same name).

  References:
    Park et al, HetPipe: Enabling Large DNN Training on (Whimpy) Heterogeneous
    GPU Clusters through Integration of Pipelined Model Parallelism and Data
    Parallelism <https://arxiv.org/abs/2005.14038>, 2020, §5
  """

  clock_distance: int
  concurrent_minibatches: int
  name = "wsp"

  def __post_init__(self):
    for arg, low in (("clock_distance", 0), ("concurrent_minibatches", 1)):
      value = getattr(self, arg)
      if not isinstance(value, int) or value < low:
        raise ValueError(f"{arg}={value!r} is invalid; it must be an integer "
                         f">= {low}")

  def start(self, ctx: policy.Context) -> policy.Runner:
    return _WSPRunner(ctx, self.clock_distance, self.concurrent_minibatches)


def wsp(clock_distance: int, concurrent_minibatches: int) -> WSP:
  """WSP with clock distance D and N_m minibatches per wave (see `WSP`).

  Time only; `stalepipe.sync.wsp(N, clock_distance, concurrent_minibatches)`
  is the same policy with its numerics, and `simulate` takes it as it is.

  Examples:
    >>> wsp(0, 4).name
    'wsp'
  """
  return WSP(clock_distance, concurrent_minibatches)


policy.TIME_SIDES["wsp"] = lambda p: WSP(p.clock_distance, p.wave)
