"""Closed forms from the source papers that the schedules are tested against.

Each function states the formula and the section it comes from; the tests in
`tests/theory_test.py` and `tests/schedules_test.py` compare them with the
figures the schedules measure.

Examples:
  >>> gpipe_bubble(4, 4), wsp_global_staleness(0, 3)
  (0.42857142857142855, 6)
  >>> timeprest_version_difference(4, 2), timeprest_single_sequence(4, 4)
  (2, True)
  >>> zero_bubble_h1_makespan(4, 8), one_f_one_b_split_makespan(4, 8)
  (27, 33)
"""

import math


_COUNTS = ("num_stages", "num_microbatches", "num_minibatches",
           "concurrent_minibatches", "num_devices", "num_chunks")


def _check(**values: int) -> None:
  """Counts must be >= 1, other arguments >= 0, and a stage below S."""
  for name, value in values.items():
    low = 1 if name in _COUNTS else 0
    if not isinstance(value, int) or value < low:
      raise ValueError(f"{name}={value!r} is invalid; it must be an integer "
                       f">= {low}")
  if "stage" in values and values["stage"] >= values["num_stages"]:
    raise ValueError(f"stage={values['stage']} is invalid; valid: 0 to "
                     f"{values['num_stages'] - 1}")


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
  r"""GPipe's bubble fraction: idle slots over all slots (also 1F1B's).

  .. math:: \frac{S - 1}{M + S - 1}

  References:
    Huang et al, GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism <https://arxiv.org/abs/1811.06965>, 2019
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches)
  return (num_stages - 1) / (num_microbatches + num_stages - 1)


def wsp_local_staleness(concurrent_minibatches: int) -> int:
  r"""HetPipe's local staleness threshold (seed 001 §4).

  .. math:: s_{local} = N_m - 1

  Examples:
    >>> wsp_local_staleness(4)
    3

  References:
    Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020 (§4)
  """
  _check(concurrent_minibatches=concurrent_minibatches)
  return concurrent_minibatches - 1


def wsp_global_staleness(clock_distance: int, s_local: int) -> int:
  r"""WSP's global staleness bound (seed 001 §5).

  .. math:: s_{global} = (D + 1)(s_{local} + 1) + s_{local} - 1

  Examples:
    >>> wsp_global_staleness(clock_distance=0, s_local=3)  # seed 001 Fig. 3
    6

  References:
    Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020 (§5)
  """
  _check(clock_distance=clock_distance, s_local=s_local)
  return (clock_distance + 1) * (s_local + 1) + s_local - 1


def hetpipe_version(minibatch: int, concurrent_minibatches: int) -> int:
  r"""The :math:`w_{local}` version minibatch :math:`p` reads (seed 001 §4).

  It holds the updates of minibatches :math:`0..p - N_m`:

  .. math:: \max(0, p - N_m + 1)

  Examples:
    >>> [hetpipe_version(p, 4) for p in range(7)]
    [0, 0, 0, 0, 1, 2, 3]
  """
  _check(minibatch=minibatch, concurrent_minibatches=concurrent_minibatches)
  return max(0, minibatch - concurrent_minibatches + 1)


def timeprest_version_difference(num_stages: int,
                                 num_microbatches: int) -> int:
  r"""TiMePReSt's version difference :math:`v`, the paper's closed form.

  .. math:: v = \left\lfloor \frac{W + N - 2}{N} \right\rfloor

  Seed 003 §4.4, eq. 25, derived from its Figures 7, 9 and 10 with the
  assumption :math:`x \sim 1/N` (eq. 18). The schedule's measured value is
  :func:`timeprest_steady_version_difference`; the two agree on every
  configuration the paper draws and on :math:`v = 1 \iff W \le N + 1`, and
  differ elsewhere (e.g. :math:`W = 6, N = 2`).

  Examples:
    >>> timeprest_version_difference(4, 2), timeprest_version_difference(5, 3)
    (2, 2)

  References:
    Dutta et al, TiMePReSt <https://arxiv.org/abs/2410.14312>, 2024 (§4.4)
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches)
  return (num_stages + num_microbatches - 2) // num_microbatches


def timeprest_steady_version_difference(num_stages: int,
                                        num_microbatches: int) -> int:
  r"""TiMePReSt's :math:`v` derived from the nF1B schedule's steady state.

  With backward priority each stage repeats :math:`N` forwards and one
  backward, so backwards leave the last stage every :math:`N + 1` ticks and
  take :math:`W` ticks to reach stage 0. When the backward of minibatch
  :math:`p` starts on the last stage, that of :math:`p - k` is complete iff
  :math:`k(N + 1) \ge W`, so the gradient holds updates up to :math:`p - v`:

  .. math:: v = \left\lceil \frac{W}{N + 1} \right\rceil

  which is 1 iff :math:`W \le N + 1`, as seed 003 eqs. 11-12 state.

  Examples:
    >>> timeprest_steady_version_difference(6, 2)
    2
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches)
  return math.ceil(num_stages / (num_microbatches + 1))


def timeprest_single_sequence(num_stages: int, num_microbatches: int) -> bool:
  r"""Whether TiMePReSt's updates form one sequence (:math:`v = 1`).

  .. math:: v = 1 \iff W \le N + 1

  Seed 003 §4.4, eqs. 11 and 12.

  Examples:
    >>> timeprest_single_sequence(4, 2), timeprest_single_sequence(4, 4)
    (False, True)
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches)
  return num_stages <= num_microbatches + 1


def pipedream_stash_depth(num_stages: int, stage: int) -> int:
  r"""Weight versions stage :math:`s` of asynchronous PipeDream keeps.

  One per minibatch in flight on the stage (1F1B admits :math:`S - s`):

  .. math:: S - s

  Examples:
    >>> [pipedream_stash_depth(4, s) for s in range(4)]
    [4, 3, 2, 1]

  References:
    Narayanan et al, PipeDream <https://arxiv.org/abs/1806.03377>, 2019
    (§3.3, weight stashing)
  """
  _check(num_stages=num_stages, stage=stage)
  return num_stages - stage


def pipedream_staleness(num_stages: int, stage: int) -> int:
  r"""Updates a minibatch misses on stage :math:`s` of asynchronous PipeDream.

  The minibatches in flight ahead of it: :math:`S - 1 - s` (steady state).

  Examples:
    >>> pipedream_staleness(4, 0)
    3
  """
  _check(num_stages=num_stages, stage=stage)
  return num_stages - 1 - stage


def pipedream_2bw_version(minibatch: int) -> int:
  r"""The version PipeDream-2BW's minibatch :math:`p` reads: one update late.

  .. math:: W^{(t+1)} = W^{(t)} - \nu \nabla f(W^{(t-1)})
     \quad\Rightarrow\quad \max(0, p - 1)

  with two versions alive per stage (:data:`PIPEDREAM_2BW_VERSIONS`).

  Examples:
    >>> [pipedream_2bw_version(p) for p in range(4)]
    [0, 0, 1, 2]

  References:
    Narayanan et al, Memory-Efficient Pipeline-Parallel DNN Training
    <https://arxiv.org/abs/2006.09503>, 2021 (§3.1)
  """
  _check(minibatch=minibatch)
  return max(0, minibatch - 1)


PIPEDREAM_2BW_VERSIONS = 2


# Zero bubble (Qi et al, ICLR 2024). Unit costs are the paper's
# T_F = T_B = T_W: a forward, an input gradient (BI) and a weight gradient
# (BW) take one tick each, an unsplit backward two.

_ZERO_BUBBLE = ("1f1b", "zb-h1", "zb-h2")


def one_f_one_b_split_makespan(num_stages: int, num_microbatches: int,
                               num_minibatches: int = 1) -> int:
  r"""1F1B's ticks when its backward costs two (input + weight gradient).

  Per minibatch, the pipeline's fill and drain cost every stage
  :math:`(S - 1)(T_F + T_B + T_W)` (Qi et al, ICLR 2024, §2, Table 2) on top
  of its :math:`M (T_F + T_B + T_W)` of work:

  .. math:: B \left(3M + 3(S - 1)\right)

  Examples:
    >>> one_f_one_b_split_makespan(4, 8)
    33

  References:
    Qi et al, Zero Bubble (Almost) Pipeline Parallelism
    <https://arxiv.org/abs/2401.10241>, 2024 (Table 2)
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches,
         num_minibatches=num_minibatches)
  return num_minibatches * (3 * num_microbatches + 3 * (num_stages - 1))


def _enough(name, num_stages, num_microbatches, least):
  if num_microbatches < least:
    raise ValueError(f"num_microbatches={num_microbatches} is invalid for "
                     f"{name}'s closed form with {num_stages} stages; it "
                     f"must be >= {least}")


def zero_bubble_h1_makespan(num_stages: int, num_microbatches: int,
                            num_minibatches: int = 1) -> int:
  r"""ZB-H1's ticks with unit costs, :math:`M \ge S` (§2.1, Table 2).

  B starts earlier and the deferred W fill the tail, so each stage idles
  :math:`(S - 1)(T_F + T_B - T_W) = S - 1` ticks per minibatch, a third of
  1F1B's :math:`3(S - 1)`; a flush separates minibatches:

  .. math:: B \left(3M + S - 1\right)

  Examples:
    >>> zero_bubble_h1_makespan(4, 8)  # Figure 3 (top)
    27
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches,
         num_minibatches=num_minibatches)
  _enough("zb-h1", num_stages, num_microbatches, num_stages)
  return num_minibatches * (3 * num_microbatches + num_stages - 1)


def zero_bubble_h1_bubble(num_stages: int, num_microbatches: int) -> float:
  r"""ZB-H1's bubble fraction with unit costs, :math:`M \ge S` (§2.1).

  .. math:: \frac{S - 1}{3M + S - 1}

  (1F1B's, :func:`gpipe_bubble`, is :math:`\frac{3(S-1)}{3M + 3(S-1)}`.)

  Examples:
    >>> zero_bubble_h1_bubble(4, 8)
    0.1111111111111111
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches)
  _enough("zb-h1", num_stages, num_microbatches, num_stages)
  return (num_stages - 1) / (3 * num_microbatches + num_stages - 1)


def zero_bubble_h2_makespan(num_stages: int, num_microbatches: int,
                            num_minibatches: int = 1) -> int:
  r"""ZB-H2's ticks with unit costs, :math:`M \ge 2S - 1` (§2.2).

  No bubble, :math:`(S - 1)(T_F + T_B - 2T_W) = 0` (Table 2), between
  minibatches either (the parallelogram of Figure 3, bottom): only the
  pipeline's one fill and drain remain,

  .. math:: 3MB + S - 1

  The asynchronous zero-bubble schedule (zb-async) reaches it from
  :math:`M \ge S` on, at ZB-H1's memory.

  Examples:
    >>> zero_bubble_h2_makespan(4, 8, 2)
    51
  """
  _check(num_stages=num_stages, num_microbatches=num_microbatches,
         num_minibatches=num_minibatches)
  _enough("zb-h2", num_stages, num_microbatches, 2 * num_stages - 1)
  return 3 * num_microbatches * num_minibatches + num_stages - 1


def zero_bubble_h2_bubble(num_stages: int, num_microbatches: int,
                          num_minibatches: int = 1) -> float:
  r"""ZB-H2's bubble fraction with unit costs, :math:`M \ge 2S - 1`.

  .. math:: \frac{S - 1}{3MB + S - 1} \to 0 \text{ as } B \to \infty

  Examples:
    >>> zero_bubble_h2_bubble(4, 8, 1) == zero_bubble_h1_bubble(4, 8)
    True
  """
  makespan = zero_bubble_h2_makespan(num_stages, num_microbatches,
                                     num_minibatches)
  return (num_stages - 1) / makespan


def zero_bubble_bubble_size(schedule: str, num_stages: int, t_f: float = 1.0,
                            t_b: float = 1.0, t_w: float = 1.0) -> float:
  r"""Idle time per stage and minibatch in the steady state (Table 2).

  With :math:`T_B` the input gradient's time and :math:`T_W` the weight
  gradient's:

  =========  ==========================================
  1f1b       :math:`(S - 1)(T_F + T_B + T_W)`
  zb-h1      :math:`(S - 1)(T_F + T_B - T_W)`
  zb-h2      :math:`(S - 1)(T_F + T_B - 2T_W)`
  =========  ==========================================

  Examples:
    >>> [zero_bubble_bubble_size(n, 4) for n in ("1f1b", "zb-h1", "zb-h2")]
    [9.0, 3.0, 0.0]

  References:
    Qi et al, Zero Bubble (Almost) Pipeline Parallelism
    <https://arxiv.org/abs/2401.10241>, 2024 (§2.3, Table 2)
  """
  _check(num_stages=num_stages)
  if schedule not in _ZERO_BUBBLE:
    raise ValueError(f"schedule={schedule!r} is invalid; valid: "
                     f"{', '.join(_ZERO_BUBBLE)}")
  for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
    if not value >= 0:
      raise ValueError(f"{name}={value!r} is invalid; it must be >= 0")
  w = {"1f1b": 1, "zb-h1": -1, "zb-h2": -2}[schedule]
  return (num_stages - 1) * (t_f + t_b + w * t_w)


def zero_bubble_activations(schedule: str, num_stages: int,
                            stage: int) -> tuple[int, int]:
  r"""Peak micro-batches stage :math:`s` holds: `(before BI, after BI)`.

  A micro-batch keeps the activations of B, :math:`M_B`, from its forward to
  its input gradient, and the smaller :math:`M_W` from there to its weight
  gradient (§2.3). At its peak stage :math:`s` (0-based) holds

  =========  ===================================================
  1f1b       :math:`(S - s) M_B`
  zb-h1      :math:`(S - s) M_B + s M_W \le S M_B`
  zb-h2      :math:`(2S - 2s - 1) M_B + 2s M_W \le (2S - 1) M_B`
  =========  ===================================================

  (the paper's worker :math:`i = s + 1`), so a stage holds :math:`S - s`,
  :math:`S` and :math:`2S - 1` micro-batches in all, given enough of them
  (:math:`M \ge S`, :math:`M \ge 2S - 1` for ZB-H2).

  Examples:
    >>> [zero_bubble_activations("zb-h1", 4, s) for s in range(4)]
    [(4, 0), (3, 1), (2, 2), (1, 3)]

  References:
    Qi et al, Zero Bubble (Almost) Pipeline Parallelism
    <https://arxiv.org/abs/2401.10241>, 2024 (§2.3, Table 2)
  """
  _check(num_stages=num_stages, stage=stage)
  if schedule not in _ZERO_BUBBLE:
    raise ValueError(f"schedule={schedule!r} is invalid; valid: "
                     f"{', '.join(_ZERO_BUBBLE)}")
  S, s = num_stages, stage
  return {"1f1b": (S - s, 0), "zb-h1": (S - s, s),
          "zb-h2": (2 * S - 2 * s - 1, 2 * s)}[schedule]


def interleaved_1f1b_makespan(num_devices: int, num_chunks: int,
                              num_microbatches: int) -> int:
  r"""Interleaved 1F1B's ticks per minibatch, unit F and B per chunk, P | M.

  Narayanan et al (SC'21, §2.2.2): a device's bubble shrinks v-fold to
  :math:`(p - 1)(t_f + t_b)/v`; with a chunk's forward and backward one tick
  each (:math:`t_f / v = t_b / v = 1`) and :math:`2vM` ticks of work,

  .. math:: 2(vM + P - 1)

  Examples:
    >>> interleaved_1f1b_makespan(4, 2, 8)
    38
  """
  _check(num_devices=num_devices, num_chunks=num_chunks,
         num_microbatches=num_microbatches)
  if num_microbatches % num_devices:
    raise ValueError(f"num_microbatches={num_microbatches} is invalid for "
                     "interleaved 1F1B's closed form with "
                     f"{num_devices} devices; it must be a multiple of them")
  return 2 * (num_chunks * num_microbatches + num_devices - 1)


def interleaved_1f1b_bubble(num_devices: int, num_chunks: int,
                            num_microbatches: int) -> float:
  r"""Interleaved 1F1B's bubble over the ideal time (Narayanan et al §2.2.2).

  .. math:: \frac{P - 1}{vM}

  Examples:
    >>> interleaved_1f1b_bubble(4, 2, 8)
    0.1875
  """
  _check(num_devices=num_devices, num_chunks=num_chunks,
         num_microbatches=num_microbatches)
  return (num_devices - 1) / (num_chunks * num_microbatches)


def zero_bubble_v_makespan(num_devices: int, num_microbatches: int) -> int:
  r"""ZB-V's ticks per minibatch with unit F, BI and BW (Qi et al §6).

  No bubble with :math:`T_F = T_B = T_W` but the V's fill and drain: each
  device works :math:`3 \cdot 2M` ticks, v = 2 chunks,

  .. math:: 3vM + P - 1 = 6M + P - 1

  and holds at most :math:`2P` chunk micro-batches, 1F1B's peak.

  Examples:
    >>> zero_bubble_v_makespan(4, 8)
    51
  """
  _check(num_devices=num_devices, num_microbatches=num_microbatches)
  return 6 * num_microbatches + num_devices - 1


def dualpipev_bubble(num_devices: int, t_f_and_b: float, t_b: float,
                     t_w: float) -> float:
  r"""DualPipeV's bubble, the DualPipe README's table (PP = 2P stages).

  .. math:: (PP/2 - 1)(T_{F\&B} + T_B - 3T_W) = (P - 1)(T_{F\&B} + T_B - 3T_W)

  :math:`T_B` is a full backward, :math:`T_{F\&B}` a forward and a
  backward overlapped; its activation memory is :math:`PP + 1 = 2P + 1`
  micro-batches of a chunk per device.

  Examples:
    >>> dualpipev_bubble(4, t_f_and_b=2, t_b=2, t_w=1)
    3
  """
  _check(num_devices=num_devices)
  return (num_devices - 1) * (t_f_and_b + t_b - 3 * t_w)
