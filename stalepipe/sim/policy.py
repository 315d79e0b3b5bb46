"""The time side of sync policies: who syncs with whom, when, and at what cost.

Pipelines are replicas along the data axis. After stage `s` of every pipeline
has finished the backward of minibatch `p` (its *ready* time), the simulator
asks the policy's runner for `sync(s, p, ready)`: the groups that exchange
parameters, the communication intervals, and the time at which version
`p + 1` of stage `s` is in place on each pipeline (*applied*). Tasks that read
that version wait for it. A runner may also *gate* a minibatch (WSP's clock
distance) and may declare updates of other pipelines that every replica is
guaranteed to reflect (`floor`, for observed staleness).

Decisions (groups, matchings, gates) are pure functions in the policy modules;
the simulator's clock bookkeeping lives in `stalepipe.sim.engine`. A later
issue's numerical `stalepipe.sync` can reuse these decisions.

This module holds the common interface and the fixed-topology policies:
`isolated` (no sync), `bsp` (ring all-reduce every iteration),
`parameter_server` (synchronous push/pull through a PS), `ad_psgd` (random
pairwise averaging) and `local_sgd(H)`.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from stalepipe import sync as sync_lib
from stalepipe.sim import cluster as cluster_lib
from stalepipe.sync.grouping import random_pairs


class CommEvent(NamedTuple):
  """Communication intervals of some pipelines' copies of one stage."""

  pipelines: np.ndarray  # [k] int
  start: np.ndarray  # [k] seconds
  end: np.ndarray  # [k] seconds


class SyncOutcome(NamedTuple):
  """What one sync of one stage after one minibatch did."""

  applied: np.ndarray  # [N] time the new version is in place per pipeline
  groups: tuple[np.ndarray, ...] | np.ndarray = ()  # disjoint sets of
  #   pipelines that averaged together (or one [groups, size] array)
  comm: tuple[CommEvent, ...] = ()


@dataclasses.dataclass(frozen=True)
class Context:
  """What a runner may look at: cluster, costs and a seeded Generator."""

  cluster: cluster_lib.Cluster
  costs: cluster_lib.StageCosts
  num_minibatches: int
  rng: np.random.Generator

  @property
  def num_pipelines(self) -> int:
    return self.cluster.num_pipelines

  def group_seconds(self, stage: int, pipelines) -> float:
    """Ring all-reduce (model averaging) of a stage's parameters in a group."""
    return cluster_lib.ring_allreduce_seconds(
        self.costs.param_bytes[stage], len(pipelines),
        self.cluster.group_link(stage, pipelines))

  def ps_seconds(self, stage: int) -> float:
    """One push or pull of the stage's parameters to its PS shard."""
    return self.cluster.ps.seconds(self.costs.param_bytes[stage])

  def ps_transfer(self, stage: int, arrivals: np.ndarray) -> np.ndarray:
    """When pushes (or pulls) issued at `arrivals` finish at the stage's shard.

    They queue (`fifo`) when the replicas share the shard's link
    (`Cluster.ps_shared`), and run side by side otherwise.
    """
    service = self.ps_seconds(stage)
    if self.cluster.ps_shared:
      return fifo(arrivals, service)
    return arrivals + service


def fifo(arrivals: np.ndarray, service: float) -> np.ndarray:
  r"""Finish times of jobs served one at a time, first come first served.

  .. math:: f_k = \max(a_k, f_{k-1}) + c

  Examples:
    >>> fifo(np.array([0.0, 0.5, 5.0]), 1.0).tolist()
    [1.0, 2.0, 6.0]
  """
  order = np.argsort(arrivals, kind="stable")
  k = np.arange(len(arrivals))
  finish = np.empty(len(arrivals))
  finish[order] = (k + 1) * service + np.maximum.accumulate(
      arrivals[order] - k * service)
  return finish


class Runner:
  """One simulation's policy state; the default never syncs."""

  gates = False  # whether `gate` can delay a minibatch
  floors = False  # whether `floor` can be above zero
  # Whether the simulator may hold a sync back until a task reads the version
  # it applies, and hand the syncs held to `sync_many` together (a runner
  # that defers neither gates nor floors).
  defers = False
  # Whether a group may hold workers at different iterations (SDPipe's
  # grouping by arrival): the simulator then walks each worker on its own
  # and hands the runner each ready signal (`signal`), taking its decisions
  # in time order (`next`, `decide`; `stalepipe.sim.arrival`).
  crosses_iterations = False

  def __init__(self, ctx: Context):
    self.ctx = ctx

  def sync(self, stage: int, minibatch: int, ready: np.ndarray) -> SyncOutcome:
    del stage, minibatch
    return SyncOutcome(applied=ready)

  def sync_many(self, stages: list, minibatch: int, ready: np.ndarray
                ) -> list[SyncOutcome]:
    """`sync` of several stages' updates of one minibatch (`ready`: `[k,
    N]`), in turn."""
    return [self.sync(s, minibatch, r) for s, r in zip(stages, ready)]

  def gate(self, stage: int, minibatch: int) -> float:
    """Earliest start of the minibatch's first task on the stage (all)."""
    del stage, minibatch
    return -np.inf

  def floor(self, stage: int, starts: np.ndarray) -> np.ndarray:
    """Updates of every pipeline a task starting at `starts` surely reflects."""
    del stage
    return np.zeros(starts.shape, dtype=int)

  def extras(self) -> dict:
    """Policy-specific records for the result (clocks, groups, ...)."""
    return {}


@dataclasses.dataclass(frozen=True)
class Isolated:
  """Pipelines never sync (a single pipeline, or independent replicas)."""

  name = "isolated"

  def start(self, ctx: Context) -> Runner:
    return Runner(ctx)


class _BSPRunner(Runner):

  def __init__(self, ctx: Context, every: int):
    super().__init__(ctx)
    self.every = every
    self.everyone = np.arange(ctx.num_pipelines)
    self.seconds = [ctx.group_seconds(s, self.everyone)
                    for s in range(ctx.cluster.num_stages)]

  def sync(self, stage, minibatch, ready):
    if (minibatch + 1) % self.every:
      return SyncOutcome(applied=ready)
    start = ready.max()
    end = np.full(len(ready), start + self.seconds[stage])
    event = CommEvent(self.everyone, np.full(len(ready), start), end)
    return SyncOutcome(end, (self.everyone,), (event,))


@dataclasses.dataclass(frozen=True)
class BSP:
  r"""All-reduce of every stage's gradients across pipelines every iteration.

  Every copy of stage `s` waits for the slowest, then a ring all-reduce of the
  stage's parameter bytes :math:`b_s` over the group's slowest link:

  .. math:: t = \max_i r_i + 2\frac{N-1}{N}\frac{b_s}{\beta} + 2(N-1)\alpha

  References:
    Sergeev and Del Balso, Horovod: fast and easy distributed deep learning
    in TensorFlow <https://arxiv.org/abs/1802.05799>, 2018 (seed 001 §8.3's
    baseline; seed 002 §5.1's All-Reduce+Pipe)
  """

  name = "bsp"

  def start(self, ctx: Context) -> Runner:
    return _BSPRunner(ctx, every=1)


@dataclasses.dataclass(frozen=True)
class LocalSGD:
  """Pipelines train alone and average all models every `period` iterations.

  References:
    Stich, Local SGD converges fast and communicates little
    <https://arxiv.org/abs/1805.09767>, 2019 (seed 002 §3.2: group size 1)
  """

  period: int
  name = "local_sgd"

  def __post_init__(self):
    if not isinstance(self.period, int) or self.period < 1:
      raise ValueError(f"period={self.period!r} is invalid; it must be an "
                       "integer >= 1")

  def start(self, ctx: Context) -> Runner:
    return _BSPRunner(ctx, every=self.period)


class _PSRunner(Runner):

  def sync(self, stage, minibatch, ready):
    service = self.ctx.ps_seconds(stage)
    pushed = self.ctx.ps_transfer(stage, ready)
    pulled = self.ctx.ps_transfer(stage, np.full(len(ready), pushed.max()))
    everyone = np.arange(len(ready))
    return SyncOutcome(pulled, (everyone,),
                       (CommEvent(everyone, pushed - service, pushed),
                        CommEvent(everyone, pulled - service, pulled)))


@dataclasses.dataclass(frozen=True)
class ParameterServer:
  r"""Synchronous parameter server: every pipeline pushes, then pulls.

  The stage's shard serves one push (or pull) of :math:`b_s` bytes at a time
  over its link, so :math:`N` replicas cost :math:`2N(\alpha + b_s/\beta)`
  once the last has pushed: the central bottleneck of seed 002 §1 (with
  `Cluster.ps_shared=False`, pushes run side by side: :math:`2(\alpha +
  b_s/\beta)`).

  References:
    Li et al, Scaling distributed machine learning with the parameter server
    <https://www.usenix.org/system/files/conference/osdi14/osdi14-paper-li_mu.pdf>,
    2014 (seed 001 §5)
  """

  name = "parameter_server"

  def start(self, ctx: Context) -> Runner:
    return _PSRunner(ctx)


class _ADPSGDRunner(Runner):

  def __init__(self, ctx, seed):
    super().__init__(ctx)
    self.seed = seed
    self.nodes = ctx.cluster.nodes.T  # [S, N]
    # [S, 2]: a pair's averaging across nodes, and within one node.
    self.seconds = np.array([[cluster_lib.ring_allreduce_seconds(
        b, 2, ctx.cluster.intra if same else ctx.cluster.inter)
                              for same in (False, True)]
                             for b in ctx.costs.param_bytes])

  def sync(self, stage, minibatch, ready):
    # The numeric side's matching (`stalepipe.sync.ADPSGD`: one per
    # iteration, seeded by (seed, minibatch)), or draws from the run's.
    rng = self.ctx.rng if self.seed is None else np.random.default_rng(
        [self.seed, minibatch])
    pairs = random_pairs(len(ready), rng, matched_only=True)
    if not len(pairs):
      return SyncOutcome(applied=ready)
    one, other = pairs[:, 0], pairs[:, 1]
    start = np.maximum(ready[one], ready[other])
    nodes = self.nodes[stage]
    end = start + self.seconds[stage][(nodes[one] == nodes[other]).view(
        np.int8)]
    applied = ready.copy()
    applied[one] = end
    applied[other] = end
    event = CommEvent(pairs.ravel(), np.repeat(start, 2), np.repeat(end, 2))
    return SyncOutcome(applied, pairs, (event,))


@dataclasses.dataclass(frozen=True)
class ADPSGD:
  """Each iteration, every stage's replicas average in random pairs.

  Partners wait for each other, then exchange models (a ring of two).

  Attributes:
    seed: None draws every stage's pairs from the run's seeded Generator;
      an int uses `stalepipe.sync.ad_psgd(N, seed)`'s matching, one per
      iteration for all stages, so timing and numerics pair alike.

  References:
    Lian et al, Asynchronous decentralized parallel stochastic gradient
    descent <https://arxiv.org/abs/1710.06952>, 2018 (seed 002 §5.1:
    "synchronizes after each mini-batch but with only a neighboring worker")
  """

  seed: int | None = None
  name = "ad_psgd"

  def start(self, ctx: Context) -> Runner:
    return _ADPSGDRunner(ctx, self.seed)


def isolated() -> Isolated:
  """No sync across pipelines.

  Examples:
    >>> isolated().name
    'isolated'
  """
  return Isolated()


def bsp() -> BSP:
  """Ring all-reduce every iteration (see `BSP`).

  Time only; `stalepipe.sync.bsp(N)` is the same policy with its numerics,
  and `simulate` takes it as it is.

  Examples:
    >>> import stalepipe as sp
    >>> s = sp.schedules.make("gpipe", num_stages=1, num_microbatches=1)
    >>> link = sp.sim.Link(bandwidth=1e9)
    >>> c = sp.sim.Cluster.grid(4, 1, intra=link, inter=link)
    >>> costs = sp.sim.StageCosts.uniform(1, 1.0, 2.0, param_bytes=4e9)
    >>> sp.sim.simulate(s, c, costs, bsp()).makespan  # 3 + 2 * 3/4 * 4
    9.0
  """
  return BSP()


def parameter_server() -> ParameterServer:
  """Synchronous push/pull through a parameter server (`ParameterServer`).

  Examples:
    >>> parameter_server().name
    'parameter_server'
  """
  return ParameterServer()


def ad_psgd() -> ADPSGD:
  """Random pairwise averaging every iteration (see `ADPSGD`).

  Time only, with pairs drawn from the run's Generator;
  `stalepipe.sync.ad_psgd(N, seed)` is the policy with its numerics, and
  `simulate` times it with the same pairs.

  Examples:
    >>> ad_psgd().name
    'ad_psgd'
  """
  return ADPSGD()


def local_sgd(period: int) -> LocalSGD:
  """Averaging of all replicas every `period` iterations (see `LocalSGD`).

  Time only; `stalepipe.sync.local_sgd(N, period)` is the same policy with
  its numerics, and `simulate` takes it as it is.

  Examples:
    >>> local_sgd(8).period
    8
  """
  return LocalSGD(period)


def time_side(policy, num_pipelines: int):
  """The simulator's side of `policy`: a time-side policy as it is, or the
  timing of a `stalepipe.sync` policy from its own arguments.

  A policy is named once, with one signature, for its numerics (the
  executors) and its timing (here): `sp.sync.wsp(N, clock_distance=D,
  concurrent_minibatches=N_m)` runs in `simulate` as `wsp(D, N_m)`; its
  numeric-only arguments (WSP's `server` and `delays`, SDPipe's
  `ready_times`: what the simulator measures) do not change the timing.

  Raises:
    ValueError: the policy's replicas are not the cluster's pipelines, or a
      `SyncPolicy` has no time side.

  Examples:
    >>> import stalepipe as sp
    >>> time_side(sp.sync.wsp(4, clock_distance=1, concurrent_minibatches=3),
    ...           num_pipelines=4)
    WSP(clock_distance=1, concurrent_minibatches=3)
  """
  if not isinstance(policy, sync_lib.SyncPolicy):
    return policy
  if policy.num_replicas != num_pipelines:
    raise ValueError(f"sync policy {policy.name!r} has num_replicas="
                     f"{policy.num_replicas}; valid: the cluster's "
                     f"{num_pipelines} pipelines")
  if policy.name not in TIME_SIDES:
    raise ValueError(f"sync policy {policy.name!r} has no time side; valid: "
                     f"{', '.join(TIME_SIDES)}")
  return TIME_SIDES[policy.name](policy)


# The time side of each `stalepipe.sync` policy, from its arguments; WSP's
# and SDPipe's modules add theirs.
TIME_SIDES = {
    "bsp": lambda p: BSP(),
    "ad_psgd": lambda p: ADPSGD(seed=p.seed),
    "local_sgd": lambda p: LocalSGD(p.period),
}
