r"""Zero-bubble schedules: the backward split into input and weight gradients.

Qi et al (ICLR 2024, §2) split each backward "B" into the input-gradient
task "BI", which the previous stage waits for, and the weight-gradient task
"BW", which nothing waits for and which may run any time after its BI on the
same stage. Deferring BW fills the bubbles of 1F1B. All three schedules here
are the list scheduler of `greedy` with a split backward and the same rules:

- a forward first, whenever it is ready and the stage is under both caps;
  otherwise the next BI; otherwise the next BW (the 1F-1B-1W steady state of
  §3.1, where "W fills the bubble");
- stage :math:`s` admits a forward while it holds fewer than ``cap``
  micro-batches (from the start of a forward to the end of its BW) and fewer
  than ``input_cap`` whose BI is still to come (those keep the activations of
  B, :math:`M_B`; after BI only the smaller :math:`M_W` remains, §2.3);
- a stage finishes a minibatch's BW tasks before it starts the next
  minibatch's BI tasks, so one gradient accumulator per stage suffices; it
  applies the minibatch's update at the end of its last BW.

With unit F, BI and BW (the paper's :math:`T_F = T_B = T_W`):

=========  =========  ===========  =========================  ==============
schedule   ``cap``    input_cap    ticks, B minibatches       version of p
=========  =========  ===========  =========================  ==============
zb-h1      S          S - s        B (3M + S - 1), M >= S     p (flush)
zb-h2      2S - 1     2(S - s) - 1 3MB + S - 1, M >= 2S - 1   p
zb-async   S          S - s        3MB + S - 1, M >= S        max(0, p - 1)
=========  =========  ===========  =========================  ==============

1F1B with the same costs (an unsplit backward of two ticks) takes
:math:`B(3M + 3(S - 1))`: ZB-H1's bubble is a third of it (§2.1, Table 2).
See `stalepipe.theory` for the closed forms.

References:
  Qi et al, Zero Bubble (Almost) Pipeline Parallelism
  <https://arxiv.org/abs/2401.10241>, ICLR 2024 (§2 handcrafted schedules,
  Figure 3, Table 2; §4 optimizer post-validation); code:
  https://github.com/sail-sg/zero-bubble-pipeline-parallelism
"""

from stalepipe.schedules import greedy
from stalepipe.schedules.core import Schedule


def _build(name, num_stages, num_microbatches, num_minibatches, *, cap,
           input_cap, delay):
  rules = greedy.Rules(
      version=lambda task, view: max(0, task.minibatch - delay),
      priority="forward", cap=cap, input_cap=input_cap, split_backward=True)
  return greedy.build(name, num_stages, num_microbatches, num_minibatches,
                      rules)


def zb_h1(num_stages: int, num_microbatches: int,
          num_minibatches: int = 1) -> Schedule:
  r"""Builds ZB-H1, zero bubble's memory-efficient schedule (§2.1).

  1F1B's warm-up (stage :math:`s` starts :math:`S - s` forwards before its
  first BI) with each BW deferred until the stage would otherwise idle or
  hold more than :math:`S` micro-batches. Every task of minibatch :math:`p`
  reads version :math:`p` (a flush between minibatches, as 1F1B), stash
  depth 1, staleness 0. With :math:`M \ge S` and unit costs the makespan is
  :math:`3M + S - 1` per minibatch (1F1B: :math:`3M + 3(S - 1)`). Stage
  :math:`s` holds at most :math:`S - s` micro-batches before their BI plus
  :math:`s` waiting only for their BW, :math:`(S - s) M_B + s M_W \le S M_B`:
  1F1B's peak, reached on stage 0 (Table 2). For :math:`S = 4, M = 8` the
  table is the paper's Figure 3 (top), task for task.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = zb_h1(num_stages=4, num_microbatches=8)
    >>> s.num_ticks, s.max_in_flight
    (27, (4, 4, 4, 4))
  """
  S = num_stages
  return _build("zb-h1", S, num_microbatches, num_minibatches,
                cap=lambda stage: S, input_cap=lambda stage: S - stage,
                delay=0)


def zb_h2(num_stages: int, num_microbatches: int,
          num_minibatches: int = 1) -> Schedule:
  r"""Builds ZB-H2, zero bubble's zero-bubble schedule (§2.2).

  Stage :math:`s` starts :math:`2(S - s) - 1` forwards before its first BI,
  which fills the bubble before it, and holds up to :math:`2S - 1`
  micro-batches: :math:`(2S - 2s - 1) M_B + 2s M_W \le (2S - 1) M_B`, about
  twice 1F1B's (Table 2). The tail's BW tasks make the parallelogram of
  Figure 3 (bottom): stage :math:`s` ends minibatch :math:`p` at
  :math:`3M(p + 1) + s` and starts :math:`p + 1` right then, so with
  :math:`M \ge 2S - 1` and unit costs :math:`B` minibatches take
  :math:`3MB + S - 1` ticks: no bubble but the pipeline's fill and drain.

  Synchronous: every task of minibatch :math:`p` reads version :math:`p`;
  each stage applies its own update after its last BW, without waiting for
  the other stages. That is exact for an update rule that needs only the
  stage's own gradient. A rule with a global check, such as clipping by the
  global gradient norm or skipping a step on a NaN anywhere, needs the norms
  of all stages before any stage updates, which would stall the
  parallelogram; the paper replaces that synchronization by a post-update
  validation with rollback (§4, Appendix C). This schedule does not model
  it, and the executor does no cross-stage check: clipping there is per
  stage.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch (zero bubble from
      :math:`2S - 1` on).
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = zb_h2(num_stages=4, num_microbatches=8, num_minibatches=2)
    >>> s.num_ticks, s.max_in_flight
    (51, (7, 7, 7, 7))
  """
  S = num_stages
  return _build("zb-h2", S, num_microbatches, num_minibatches,
                cap=lambda stage: 2 * S - 1,
                input_cap=lambda stage: 2 * (S - stage) - 1, delay=0)


def zb_async(num_stages: int, num_microbatches: int,
             num_minibatches: int = 1) -> Schedule:
  r"""Builds the asynchronous zero-bubble schedule: ZB-H1 without flushes.

  ZB-H1's rules and memory (at most :math:`S` micro-batches held, :math:`S -
  s` before their BI), but minibatch :math:`p + 1`'s forwards follow
  minibatch :math:`p`'s without waiting for its update: BW tasks of
  :math:`p` run past the point where a flush would have updated. Every task
  of minibatch :math:`p`, on every stage, reads

  .. math:: \text{version}(p) = \max(0, p - 1),

  its BI and BW the version its forward read (weight stashing), as
  PipeDream-2BW's double-buffered weights (Narayanan et al, 2021, §3.1): an
  update uses the gradient of the weights one update old,

  .. math:: W^{(p+1)} = W^{(p)} - \nu \nabla f(W^{(p-1)}),

  so the staleness is 1 (0 for minibatch 0) and each stage keeps two
  versions (stash depth 2). With :math:`M \ge S` version :math:`p - 1` is in
  place when minibatch :math:`p` arrives, so no stage waits for it and, with
  unit costs, :math:`B` minibatches take :math:`3MB + S - 1` ticks: ZB-H2's
  throughput at ZB-H1's (1F1B's) activation memory. :math:`M = S - 1` stalls
  once, in the fill; smaller :math:`M` stalls every other minibatch (a
  steady state two minibatches long) and is rejected, as in 2BW.

  Args:
    num_stages: S, pipeline stages.
    num_microbatches: M, micro-batches per minibatch, at least S - 1.
    num_minibatches: B, minibatches in the table.

  Returns:
    The schedule.

  Examples:
    >>> s = zb_async(num_stages=4, num_microbatches=4, num_minibatches=6)
    >>> [s.version(p, 0, "F") for p in range(6)], s.stash_depth
    ([0, 0, 1, 2, 3, 4], (2, 2, 2, 2))
    >>> s.num_ticks == 3 * 4 * 6 + 4 - 1
    True
  """
  S = num_stages
  if num_microbatches < S - 1:
    raise ValueError(f"num_microbatches={num_microbatches} is invalid for "
                     f"zb-async with {S} stages; it must be >= num_stages - 1")
  return _build("zb-async", S, num_microbatches, num_minibatches,
                cap=lambda stage: S, input_cap=lambda stage: S - stage,
                delay=1)
