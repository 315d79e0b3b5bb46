"""SDPipe's semi-decentralized group scheduling, time side (seed 002 §3).

The scheduler itself (grouping, validation, deadlock skip) is
`stalepipe.sync.grouping.Scheduler`; this module runs it on simulated time.

A central scheduler, one per stage, collects ready signals from the stage's
replicas (one per pipeline). Workers that signal within a window `T` of the
first form a group and average their models (Algorithm 2, §3.2); a group
that holds every worker still expected closes at once. The sync graph of the
last `P` iterations, whose edges join members of a group, must stay connected
(Assumption 1, §3.3): when this iteration's groups would break it, the
scheduler makes the earliest group that bridges two components wait for the
next group and merges them, until the graph is connected (§3.4, group
validation; tracked with union-find as the implementation in §4 does).

Deadlock prevention (§3.4): an enforcement on one stage may not begin while
an enforcement on another stage is still waiting; such a validation is
skipped for the iteration (the connectivity may be violated briefly) and
counted.

By default grouping is per iteration: the replicas of stage `s` that
finished minibatch `p` are grouped among themselves (the global clock `k` of
eq. 1). The simulator processes events in dependency order, so a wait on
another stage is "still waiting" when its interval covers this stage's first
ready time. With `grouping="arrival"` the scheduler groups whoever signals
within T, whatever iteration each is at (Algorithm 2 as written;
`grouping.ArrivalScheduler`), and the simulator walks each worker on its own
in time order (`stalepipe.sim.arrival`).
"""

import dataclasses
import math

import numpy as np

from stalepipe.sim import cluster as cluster_lib
from stalepipe.sim import policy
from stalepipe.sync import grouping as grouping_lib


def _averaging_seconds(ctx) -> np.ndarray:
  """`[S, 2, N + 1]`: a group's averaging by its size, across nodes and
  within one."""
  return np.array([[[0.0] + [
      cluster_lib.ring_allreduce_seconds(b, n, link)
      for n in range(1, ctx.num_pipelines + 1)]
                    for link in (ctx.cluster.inter, ctx.cluster.intra)]
                   for b in ctx.costs.param_bytes])


class _SDPipeRunner(policy.Runner):

  defers = True  # the stages of a minibatch decide together

  def __init__(self, ctx, scheduler):
    super().__init__(ctx)
    self.scheduler = scheduler
    self.nodes = ctx.cluster.nodes.T  # [S, N]
    self.seconds = _averaging_seconds(ctx)

  def sync(self, stage, minibatch, ready):
    return self.sync_many([stage], minibatch, ready[None])[0]

  def sync_many(self, stages, minibatch, ready):
    """Every stage's groups, then their averaging times all at once."""
    batch = self.scheduler.decide_many(stages, minibatch, ready)
    k, N = ready.shape
    finish = batch.start.copy()  # a lone worker is done when its window
    sizes = np.diff(batch.heads, append=k * N)  # closes
    multi = sizes > 1
    in_multi = np.repeat(multi, sizes)
    together = batch.members.ravel()[in_multi]
    counts = sizes[multi]
    heads = np.cumsum(counts) - counts
    row = batch.heads[multi] // N
    stage = np.asarray(stages)[row]
    nodes = self.nodes[stages].ravel()[batch.positions[in_multi]]
    one_node = (np.minimum.reduceat(nodes, heads)
                == np.maximum.reduceat(nodes, heads)) if len(heads) else heads
    begin = finish[multi]
    end = begin + self.seconds[stage, one_node.astype(np.intp), counts]
    finish[multi] = end
    applied = np.empty(k * N)
    applied[batch.positions] = np.repeat(finish, sizes)
    cut = np.searchsorted(row, np.arange(k + 1))  # each row's groups of 2+
    at = np.append(heads, len(together))[cut]  # and their members
    begins, ends = np.repeat(begin, counts), np.repeat(end, counts)
    return [policy.SyncOutcome(
        applied[r * N:r * N + N], batch.groups[r],
        (policy.CommEvent(together[at[r]:at[r + 1]], begins[at[r]:at[r + 1]],
                          ends[at[r]:at[r + 1]]),) if cut[r + 1] > cut[r]
        else ()) for r in range(k)]

  def extras(self):
    return {"sdpipe_groups": self.scheduler.groups,
            "sdpipe_skipped": self.scheduler.skipped}


class _ArrivalRunner(policy.Runner):
  """SDPipe grouping by arrival: the simulator hands each ready signal as it
  happens (`signal`) and takes the scheduler's decisions in time order
  (`next`, `decide`; `stalepipe.sim.arrival`)."""

  crosses_iterations = True

  def __init__(self, ctx, scheduler):
    super().__init__(ctx)
    self.scheduler = scheduler
    self.nodes = ctx.cluster.nodes.T  # [S, N]
    self.seconds = _averaging_seconds(ctx)

  def signal(self, stage, worker, iteration, time):
    self.scheduler.signal(stage, worker, iteration, time)

  def next(self):
    return self.scheduler.next()

  def decide(self, stage):
    """`(group, end)`: the group sent and when its averaging ends (a lone
    worker's when its window closes), or None."""
    group = self.scheduler.decide(stage)
    if group is None:
      return None
    nodes = self.nodes[stage, group.members]
    one_node = int(nodes.min() == nodes.max())
    return group, group.close + self.seconds[stage, one_node,
                                             len(group.members)]

  def extras(self):
    return {"sdpipe_arrivals": self.scheduler.groups,
            "sdpipe_skipped": self.scheduler.skipped}


@dataclasses.dataclass(frozen=True)
class SDPipe:
  """SDPipe's scheduler with connectivity budget `P` and window `T`.

  Attributes:
    history: P >= 1, iterations over which each stage's sync graph must be
      connected (seed 002 §5.1 uses 10).
    window: T in seconds, how long a group stays open (seed 002 §5.1 uses
      1/N of the iteration time); `math.inf` degrades to all-reduce.
    enforce: validate connectivity (§3.4); off, replicas may drift apart.
    min_size: §4's adaptive timeout: a window that closes with fewer ready
      workers is enlarged until this many joined (1: T fixed;
      `grouping.window_groups`).
    history_unit: what P counts, "iteration" or "group" (group-sync
      operations, §3.2's clock k; `grouping.Scheduler`).
    grouping: "iteration" (the replicas that finished the same minibatch
      group among themselves; what the lockstep executor replays) or
      "arrival" (Algorithm 2 as written: whoever signals within T, whatever
      iteration each is at; the simulator only:
      `grouping.ArrivalScheduler`). Under "arrival" the records are
      `extras["sdpipe_arrivals"]` (per stage, the groups in time order,
      `grouping.Arrival`: members, the iteration each signalled after, ready
      times, close) instead of `"sdpipe_groups"`.

  References:
    Miao et al, SDPipe: A Semi-Decentralized Framework for Heterogeneity-aware
    Pipeline-parallel Training <https://doi.org/10.14778/3598581.3598604>,
    2023, §3
  """

  history: int
  window: float
  enforce: bool = True
  min_size: int = 1
  history_unit: str = "iteration"
  grouping: str = "iteration"
  name = "sdpipe"

  def __post_init__(self):
    grouping_lib.check(self.history, self.window, self.min_size,
                   self.history_unit, self.grouping)

  def start(self, ctx: policy.Context) -> policy.Runner:
    if self.grouping == "arrival":
      return _ArrivalRunner(ctx, grouping_lib.ArrivalScheduler(
          ctx.cluster.num_stages, ctx.num_pipelines, ctx.num_minibatches,
          self.history, self.window, self.enforce, self.min_size,
          self.history_unit))
    return _SDPipeRunner(ctx, grouping_lib.Scheduler(
        ctx.cluster.num_stages, self.history, self.window, self.enforce,
        self.min_size, self.history_unit))


def sdpipe(history: int = 10, window: float = math.inf,
           enforce: bool = True, min_size: int = 1,
           history_unit: str = "iteration",
           grouping: str = "iteration") -> SDPipe:
  """SDPipe with connectivity budget P=`history` and window T=`window` seconds.

  Time only; `stalepipe.sync.sdpipe(N, history, window)` is the same policy
  with its numerics, and `simulate` takes it as it is.

  Examples:
    >>> sdpipe(10, 0.05).window
    0.05
  """
  return SDPipe(history, window, enforce, min_size, history_unit, grouping)


policy.TIME_SIDES["sdpipe"] = lambda p: SDPipe(
    p.history, p.window, p.enforce, p.min_size, p.history_unit, p.grouping)
