"""SDPipe's semi-decentralised group averaging, numeric side (seed 002 §3).

After each iteration's update, the replicas of each stage average their
weights within the groups a central scheduler forms (Algorithm 1, step B;
eq. 1: :math:`X_{k+1} = (X_k - \\gamma G_k) W_k`). The scheduler (Algorithm 2)
groups the workers whose ready signals arrive within a window T of the first;
it validates each iteration's groups so that the sync graph of the last P
iterations stays connected, making a group wait for the next one until it is
(§3.4, union-find as in §4), and it skips a validation that would wait while
another stage's enforcement is still waiting (deadlock prevention, §3.4,
Figure 3). The grouping and validation are the simulator's
(`stalepipe.sync.grouping`, which the simulator runs too); here they are
replayed from ready times, so the lock-step executor averages exactly the
groups the simulated cluster formed.

Groups form per iteration here: the replicas that finished minibatch p
average among themselves (eq. 1's `W_k` per iteration). Algorithm 2 as
written groups whoever signals within T, whatever iteration each is at
(`grouping="arrival"`). The lockstep executor cannot run that: with
replica a after iteration k and replica b after k + 1 in one group, a's
iteration k + 1 starts from the group's average, which holds b's weights
after b's own iteration k + 1, and the executor runs both iterations k + 1
in the same step. The policy
takes the option, so that one object names SDPipe for the executor and the
simulator (`stalepipe.sim.simulate` times it), and refuses to give numbers
for it (`mixing`).
"""

import math

import numpy as np

from stalepipe.sync import base
from stalepipe.sync import grouping as grouping_lib


class SDPipe(base.SyncPolicy):
  """SDPipe's scheduler over a ready-time trace.

  Args:
    num_replicas: N, replicas of each stage.
    history: P >= 1, iterations over which the sync graph must be connected.
    window: T, seconds a group stays open (`math.inf`: all-reduce of models).
    ready_times: `[iterations, stages, N]` seconds at which each worker
      signals ready (e.g. the simulator's); iterations past its end (or all,
      when None) have every worker ready at once.
    enforce: validate connectivity (turn off to see replicas drift apart).
    min_size: §4's adaptive timeout: a window that closes with fewer ready
      workers is enlarged until this many joined (1: T fixed).
    history_unit: what P counts: "iteration" (every group of one
      iteration validated at once) or "group" (group-sync operations, §3.2's
      clock k; `grouping.Scheduler`).
    grouping: "iteration" (the executor and the simulator) or "arrival"
      (Algorithm 2 across iterations, §3.1-3.2: the simulator only;
      `mixing` refuses it).

  References:
    Miao et al, SDPipe: A Semi-Decentralized Framework for Heterogeneity-aware
    Pipeline-parallel Training <https://doi.org/10.14778/3598581.3598604>,
    2023, §3.2-3.4
  """

  name = "sdpipe"

  def __init__(self, num_replicas: int, history: int = 10,
               window: float = math.inf, ready_times=None,
               enforce: bool = True, min_size: int = 1,
               history_unit: str = "iteration", grouping: str = "iteration"):
    super().__init__(num_replicas)
    grouping_lib.check(history, window, min_size, history_unit, grouping)
    self.history, self.window, self.enforce = history, window, enforce
    self.min_size, self.history_unit = min_size, history_unit
    self.grouping = grouping
    self.ready_times = (None if ready_times is None
                        else np.asarray(ready_times, float))
    if self.ready_times is not None and (
        self.ready_times.ndim != 3 or self.ready_times.shape[2] != num_replicas):
      raise ValueError(f"ready_times of shape {self.ready_times.shape} is "
                       f"invalid; valid: [iterations, stages, {num_replicas}]")
    self._num_stages = 1 if self.ready_times is None else self.ready_times.shape[1]
    self._reset()

  def _reset(self):
    self._scheduler = grouping_lib.Scheduler(self._num_stages, self.history,
                                         self.window, self.enforce,
                                         self.min_size, self.history_unit)
    self._iterations = 0

  @property
  def skipped(self) -> list[tuple[int, int]]:
    """(stage, iteration) whose validation deadlock prevention skipped."""
    return self._scheduler.skipped

  def _ready(self, iteration: int) -> np.ndarray:
    if self.ready_times is not None and iteration < len(self.ready_times):
      return self.ready_times[iteration]
    return np.zeros((self._num_stages, self.num_replicas))

  def _schedule(self, iteration: int):
    """Runs the scheduler up to `iteration`, stages in ready order."""
    while self._iterations <= iteration:
      k, ready = self._iterations, self._ready(self._iterations)
      order = sorted(range(self._num_stages), key=lambda j: ready[j].min())
      self._scheduler.decide_many(order, k, ready[order])
      self._iterations += 1

  def check_lockstep(self) -> None:
    """Raises a one-line ValueError unless the executor can run the groups."""
    if self.grouping != "iteration":
      raise ValueError(
          f"grouping={self.grouping!r} forms groups across iterations, which "
          "the lockstep executor cannot run; valid: grouping='iteration' (the "
          "executor and the simulator) or 'arrival' (the simulator only)")

  def mixing(self, stage: int, minibatch: int) -> np.ndarray:
    """Eq. 2's `W` of the groups the scheduler formed for this iteration."""
    self.check_lockstep()
    if stage >= self._num_stages:
      if self.ready_times is not None:
        raise ValueError(f"stage {stage} is not in ready_times of "
                         f"{self._num_stages} stages; valid: 0 to "
                         f"{self._num_stages - 1}")
      self._num_stages = stage + 1  # no trace: every stage ready at once
      self._reset()
    self._schedule(minibatch)
    return base.group_mixing(self._scheduler.groups[stage][minibatch],
                             self.num_replicas)


def sdpipe(num_replicas: int, history: int = 10, window: float = math.inf,
           ready_times=None, enforce: bool = True, min_size: int = 1,
           history_unit: str = "iteration",
           grouping: str = "iteration") -> SDPipe:
  """SDPipe (see `SDPipe`).

  Examples:
    >>> sdpipe(3).mixing(0, 0)[0]  # everybody ready at once: all-reduce
    array([0.33333334, 0.33333334, 0.33333334], dtype=float32)
  """
  return SDPipe(num_replicas, history, window, ready_times, enforce,
                min_size, history_unit, grouping)
