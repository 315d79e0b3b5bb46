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

Grouping is per iteration: the replicas of stage `s` that finished minibatch
`p` are grouped among themselves (the global clock `k` of eq. 1). The
simulator processes events in dependency order, so a wait on another stage
is "still waiting" when its interval covers this stage's first ready time.
"""

import dataclasses
import math

import numpy as np

from stalepipe.sim import policy
from stalepipe.sync.grouping import Scheduler


class _SDPipeRunner(policy.Runner):

  def __init__(self, ctx, history, window, enforce=True):
    super().__init__(ctx)
    self.scheduler = Scheduler(ctx.cluster.num_stages, history, window,
                               enforce)
    self.nodes = ctx.cluster.nodes.T  # [S, N]

  def sync(self, stage, minibatch, ready):
    groups, starts = self.scheduler.decide(stage, minibatch, ready)
    sizes, offsets, members = groups.sizes, groups.offsets, groups.members
    starts = np.asarray(starts)
    nodes = self.nodes[stage][members]
    heads = offsets[:-1]
    one_node = (np.minimum.reduceat(nodes, heads)
                == np.maximum.reduceat(nodes, heads))
    ctx = self.ctx
    bandwidth = np.where(one_node, ctx.cluster.intra.bandwidth,
                         ctx.cluster.inter.bandwidth)
    latency = np.where(one_node, ctx.cluster.intra.latency,
                       ctx.cluster.inter.latency)
    # cluster.ring_allreduce_seconds, one group per entry.
    seconds = (2 * (sizes - 1) / sizes * ctx.costs.param_bytes[stage]
               / bandwidth + 2 * (sizes - 1) * latency)
    multi = sizes > 1
    finish = np.where(multi, starts + seconds, starts)
    applied = ready.copy()
    applied[members] = np.repeat(finish, sizes)
    averaging = np.repeat(multi, sizes)
    comm = ()
    if multi.any():
      comm = (policy.CommEvent(members[averaging],
                               np.repeat(starts[multi], sizes[multi]),
                               np.repeat(finish[multi], sizes[multi])),)
    return policy.SyncOutcome(applied, groups, comm)

  def extras(self):
    return {"sdpipe_groups": self.scheduler.groups,
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

  References:
    Miao et al, SDPipe: A Semi-Decentralized Framework for Heterogeneity-aware
    Pipeline-parallel Training <https://doi.org/10.14778/3598581.3598604>,
    2023, §3
  """

  history: int
  window: float
  enforce: bool = True
  name = "sdpipe"

  def __post_init__(self):
    if not isinstance(self.history, int) or self.history < 1:
      raise ValueError(f"history={self.history!r} is invalid; it must be an "
                       "integer >= 1")
    if not self.window >= 0:
      raise ValueError(f"window={self.window!r} is invalid; it must be >= 0 "
                       "seconds")

  def start(self, ctx: policy.Context) -> policy.Runner:
    return _SDPipeRunner(ctx, self.history, self.window, self.enforce)


def sdpipe(history: int = 10, window: float = math.inf,
           enforce: bool = True) -> SDPipe:
  """SDPipe with connectivity budget P=`history` and window T=`window` seconds.

  Time only; `stalepipe.sync.sdpipe(N, history, window)` is the same policy
  with its numerics, and `simulate` takes it as it is.

  Examples:
    >>> sdpipe(10, 0.05).window
    0.05
  """
  return SDPipe(history, window, enforce)


policy.TIME_SIDES["sdpipe"] = lambda p: SDPipe(p.history, p.window, p.enforce)
