"""Schedules: dependencies, causality, periodicity and the papers' theory."""

import dataclasses
import itertools
import re

from hypothesis import given, settings, strategies as st
import pytest

import stalepipe as sp
from stalepipe import theory

ASYNC = ("pipedream", "2bw", "hetpipe", "timeprest", "zb-async",
         "pipedream-interleaved", "pipedream-v")
SYNC_ZERO_BUBBLE = ("zb-h1", "zb-h2")
FAST = settings(max_examples=12, deadline=None)


def make(name, S, M, B, **kw):
  """Builds a schedule; 2BW and zb-async stall below M = S, so smaller M is
  raised to S. The device-level schedules get two chunks a device where S is
  even (the V schedules: odd S raised by one), M a multiple of
  interleaved 1F1B's rounds, DualPipeV's M >= S and PipeDream's M = 1 on
  chunks."""
  if name in ("2bw", "zb-async"):
    M = max(M, S)
  if name == "hetpipe":
    kw.setdefault("concurrent_minibatches", min(S, 3))
  if name in ("pipedream-interleaved", "pipedream-v"):
    M = 1
  if name in ("interleaved-1f1b", "looped-bfs", "pipedream-interleaved"):
    kw.setdefault("num_devices", max(1, S // 2 if S % 2 == 0 else S))
    M -= M % max(1, M // kw["num_devices"])
  if name in ("zb-v", "dualpipev", "pipedream-v"):
    S += S % 2
  if name == "dualpipev":
    M = max(M, S)
  return sp.schedules.make(name, num_stages=S, num_microbatches=M,
                           num_minibatches=B, **kw)


def by_minibatch(schedule, p):
  return [t for t in schedule.tasks if t.minibatch == p]


@pytest.mark.parametrize("name", sp.schedules.names())
@pytest.mark.parametrize("S,M", [(1, 1), (2, 1), (3, 2), (4, 4), (5, 2)])
def test_every_schedule_is_valid(name, S, M):
  s = make(name, S, M, 5).validate()
  busy = sum(s.durations[t.kind] for t in s.tasks)  # no overlaps: validated
  assert s.bubble_fraction == pytest.approx(
      1 - busy / (s.num_ticks * s.num_stages))
  assert 0.0 <= s.bubble_fraction < 1.0
  assert s.version_difference >= 1


@pytest.mark.parametrize("name", sp.schedules.names())
def test_unknown_options_rejected(name):
  with pytest.raises(ValueError, match="num_stages=0"):
    make(name, 0, 1, 1)
  with pytest.raises(ValueError, match="unknown schedule"):
    sp.schedules.make("zigzag", num_stages=2, num_microbatches=1)


@pytest.mark.parametrize("name",
                         ASYNC + SYNC_ZERO_BUBBLE + ("pipedream_vs",))
@pytest.mark.parametrize("S,M", [(2, 1), (3, 2), (4, 1), (4, 2), (5, 3),
                                 (3, 5)])
def test_causal(name, S, M):
  """Adding minibatches never changes the past (DESIGN.md, windows)."""
  kw = {}
  if name == "pipedream_vs":
    name, kw = "pipedream", {"vertical_sync": True}
  big = make(name, S, M, 9, **kw)
  for b in (1, 3, 6):
    small = make(name, S, M, b, **kw)
    entry = next(t.tick for t in big.tasks
                 if t.minibatch == b and t.stage == 0 and t.microbatch == 0)
    small_tasks = set(small.tasks)
    for t in big.tasks:
      if t.tick < entry:
        assert t in small_tasks, (name, b, t)
        assert small.task_version(t) == big.task_version(t), (name, b, t)


@pytest.mark.parametrize("name", ASYNC + SYNC_ZERO_BUBBLE)
@pytest.mark.parametrize("S,M", [(2, 1), (3, 2), (4, 1), (4, 3), (6, 2),
                                 (3, 5)])
def test_periodic_in_steady_state(name, S, M):
  """Minibatch p+P repeats minibatch p shifted in time, P versions on.

  P = 1 for every schedule but HetPipe, which repeats per wave of N_m
  minibatches when N_m minibatches do not fill the pipeline.
  """
  n_m = min(S, 3)
  B = 6 * S + 6 * n_m
  s = make(name, S, M, B)

  def repeats(P):
    shifts = set()
    for p in range(2 * S + 2 * n_m, B - 2 * S - 2 * n_m):
      now, nxt = by_minibatch(s, p), by_minibatch(s, p + P)
      shift = nxt[0].tick - now[0].tick
      shifts.add(shift)
      if [(t.tick + shift, t.stage, t.kind, t.microbatch) for t in now] != [
          (t.tick, t.stage, t.kind, t.microbatch) for t in nxt]:
        return False
      if [s.task_version(t) + P for t in now] != [
          s.task_version(t) for t in nxt]:
        return False
    return len(shifts) == 1

  assert repeats(1) or (name == "hetpipe" and repeats(n_m))


def _first_with(schedule, pred):
  return next(t for t in schedule.tasks if pred(t))


@pytest.mark.parametrize("name", sp.schedules.names())
def test_validator_names_the_offending_task(name):
  s = make(name, 3, 2, 3)
  # A backward (B, or the input-gradient part of a split one) moved to the
  # tick of its own forward.
  b = _first_with(s, lambda t: t.kind in ("B", "BI") and t.stage == 1)
  early = b._replace(tick=0)
  tasks = tuple(sorted([early if t == b else t for t in s.tasks],
                       key=lambda t: (t.tick, t.stage)))
  with pytest.raises(ValueError,
                     match=rf"Task\(tick=0, stage=1, kind='{b.kind}'"):
    dataclasses.replace(s, tasks=tasks).validate()
  # A version that the stage has not produced yet.
  t = s.tasks[-1]
  key = (t.minibatch, t.stage, t.kind, t.microbatch)
  versions = dict(s.versions)
  versions[key] = s.applied(t.stage, t.tick) + 1
  with pytest.raises(ValueError, match=re.escape(f"{t} reads version")):
    dataclasses.replace(s, versions=versions).validate()
  # A forward dropped.
  gone = _first_with(s, lambda t: t.kind == "F" and t.stage == 1)
  tasks = tuple(t for t in s.tasks if t != gone)
  with pytest.raises(ValueError, match="lacks"):
    dataclasses.replace(s, tasks=tasks).validate()


def test_validator_rejects_overlap():
  s = make("gpipe", 2, 2, 1)
  a, b = s.tasks[0], s.tasks[1]
  moved = b._replace(tick=a.tick, stage=a.stage)
  tasks = tuple(sorted([moved if t == b else t for t in s.tasks],
                       key=lambda t: (t.tick, t.stage)))
  with pytest.raises(ValueError, match="overlaps"):
    dataclasses.replace(s, tasks=tasks).validate()


# Synchronous schedules: GPipe's bubble and the flush.


@FAST
@given(S=st.integers(1, 8), M=st.integers(1, 12), B=st.integers(1, 3))
def test_sync_bubble_is_gpipes(S, M, B):
  for name in ("gpipe", "1f1b"):
    s = make(name, S, M, B).validate()
    assert s.bubble_fraction == pytest.approx(theory.gpipe_bubble(S, M))
    assert s.num_ticks == 2 * B * (M + S - 1)
    assert s.staleness == (0,) * B and s.version_difference == 1
    assert s.stash_depth == (1,) * S
    for t in s.tasks:
      assert s.task_version(t) == t.minibatch


@FAST
@given(S=st.integers(1, 8), M=st.integers(1, 12))
def test_1f1b_holds_fewer_activations(S, M):
  s = make("1f1b", S, M, 2)
  assert s.max_in_flight == tuple(min(S - k, M) for k in range(S))
  assert make("gpipe", S, M, 2).max_in_flight == (M,) * S


# PipeDream, vertical sync, 2BW.


@FAST
@given(S=st.integers(1, 7), M=st.integers(1, 4))
def test_pipedream_weight_stashing(S, M):
  s = make("pipedream", S, M, 2 * S + 2).validate()
  for t in s.tasks:
    if t.kind == "B":
      assert s.task_version(t) == s.version(t.minibatch, t.stage, "F",
                                            t.microbatch)


@FAST
@given(S=st.integers(1, 7), M=st.integers(1, 4))
def test_pipedream_without_weight_stashing(S, M):
  """A backward reads the latest version at its start: version p (every
  earlier minibatch's backwards ran before it on its stage); forwards and
  ticks are those of weight stashing."""
  B = 2 * S + 2
  stashed = make("pipedream", S, M, B)
  s = make("pipedream", S, M, B, weight_stashing=False).validate()
  assert s.tasks == stashed.tasks
  for t in s.tasks:
    if t.kind == "B":
      assert s.task_version(t) == t.minibatch == s.applied(t.stage, t.tick)
    else:
      assert s.task_version(t) == stashed.task_version(t)
  if S > 1 and B > S:  # a forward missed updates its backward sees
    assert any(s.version(p, 0, "F", 0) < p for p in range(B))


@FAST
@given(S=st.integers(1, 7))
def test_pipedream_versions_and_stash_match_theory(S):
  B = 2 * S + 2
  s = make("pipedream", S, 1, B)
  for p, k in itertools.product(range(B), range(S)):
    assert s.version(p, k, "F") == max(
        0, p - theory.pipedream_staleness(S, k))
  assert s.stash_depth == tuple(theory.pipedream_stash_depth(S, k)
                                for k in range(S))
  assert s.max_in_flight == s.stash_depth
  assert s.version_difference == theory.pipedream_staleness(S, 0) + 1


@FAST
@given(S=st.integers(1, 7), M=st.integers(1, 3))
def test_pipedream_vertical_sync_is_one_version_across_stages(S, M):
  s = make("pipedream", S, M, 2 * S + 2, vertical_sync=True).validate()
  for t in s.tasks:
    assert s.task_version(t) == s.version(t.minibatch, 0, "F", t.microbatch)
  if M == 1:
    assert [s.version(p, 0, "F") for p in range(2 * S + 2)] == [
        max(0, p - S + 1) for p in range(2 * S + 2)]


@FAST
@given(S=st.integers(1, 7), extra=st.integers(0, 4))
def test_2bw_one_update_delay_and_two_versions(S, extra):
  M, B = S + extra, 2 * S + 3
  s = make("2bw", S, M, B).validate()
  for t in s.tasks:
    assert s.task_version(t) == theory.pipedream_2bw_version(t.minibatch)
  assert s.stash_depth == (theory.PIPEDREAM_2BW_VERSIONS,) * S
  # The version is always there: after the fill, stage 0 never idles
  # until the drain.
  busy = s.busy[:, 0]
  first_b = next(t.tick for t in s.tasks if t.stage == 0 and t.kind == "B")
  last_f = max(t.tick for t in s.tasks if t.stage == 0 and t.kind == "F")
  assert busy[:S].all() and busy[first_b:last_f + 1].all()


# HetPipe and WSP.


@FAST
@given(S=st.integers(1, 7), n_m=st.integers(1, 6), M=st.integers(1, 2))
def test_hetpipe_versions_and_local_staleness(S, n_m, M):
  B = 3 * n_m + 2
  s = make("hetpipe", S, M, B, concurrent_minibatches=n_m).validate()
  for t in s.tasks:
    assert s.task_version(t) == theory.hetpipe_version(t.minibatch, n_m)
    assert (t.kind == "FB") == (t.stage == S - 1)
  assert s.staleness == tuple(min(p, theory.wsp_local_staleness(n_m))
                              for p in range(B))
  assert s.version_difference == n_m
  assert s.stash_depth == (n_m,) * S  # w_p kept until p's backward


@pytest.mark.parametrize("S", [2, 4, 6])
@pytest.mark.parametrize("n_m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("D", [0, 1, 3])
def test_wsp_global_staleness_measured(S, n_m, D):
  s = make("hetpipe", S, 1, n_m * (D + 4), concurrent_minibatches=n_m)
  measured = sp.schedules.measured_global_staleness(s, D)
  bound = theory.wsp_global_staleness(D, theory.wsp_local_staleness(n_m))
  assert measured <= bound
  if n_m <= S:  # N_m minibatches fill the pipeline: the bound is reached
    assert measured == bound


@pytest.mark.parametrize("S", [2, 3, 4, 5, 7])
def test_2bw_accepts_one_microbatch_fewer_than_stages(S):
  """M = S - 1: the same version map, two versions and a bubble-free
  steady state of 2M ticks per minibatch on every stage."""
  M, B = S - 1, 3 * S + 4
  s = sp.schedules.make("2bw", num_stages=S, num_microbatches=M,
                        num_minibatches=B).validate()
  for t in s.tasks:
    assert s.task_version(t) == theory.pipedream_2bw_version(t.minibatch)
  assert s.stash_depth == (theory.PIPEDREAM_2BW_VERSIONS,) * S
  for k in range(S):
    first = [min(t.tick for t in s.tasks if t.stage == k and t.minibatch == p)
             for p in range(B)]
    assert {b - a for a, b in zip(first[2:-2], first[3:-1])} == {2 * M}
    steady = s.busy[first[2]:first[-2], k]
    assert steady.all(), (k, steady)


def test_2bw_rejects_too_few_microbatches():
  with pytest.raises(ValueError, match=r"^num_microbatches=2 is invalid for "
                     r"2bw with 4 stages; it must be >= num_stages - 1$"):
    sp.schedules.make("2bw", num_stages=4, num_microbatches=2)
  sp.schedules.make("2bw", num_stages=4, num_microbatches=3)


def test_hetpipe_rejects_bad_concurrency():
  with pytest.raises(ValueError, match="concurrent_minibatches=0"):
    make("hetpipe", 2, 1, 2, concurrent_minibatches=0)


# TiMePReSt.


@pytest.mark.parametrize("W", range(2, 11))
@pytest.mark.parametrize("N", range(1, 7))
def test_timeprest_version_difference(W, N):
  s = make("timeprest", W, N, 3 * W + 3).validate()
  v = s.version_difference
  assert v == theory.timeprest_steady_version_difference(W, N)
  assert (v == 1) == theory.timeprest_single_sequence(W, N)
  if (W, N) in ((4, 2), (4, 4), (3, 3), (5, 3)):  # seed 003 Figures 7, 9, 10
    assert v == theory.timeprest_version_difference(W, N)


@FAST
@given(W=st.integers(1, 8), N=st.integers(1, 5))
def test_timeprest_vertical_sync_and_backward_priority(W, N):
  B = 2 * W + 2
  s = make("timeprest", W, N, B).validate()
  assert s.backward_covers_minibatch
  entry = {(t.minibatch, t.microbatch): t.tick for t in s.tasks
           if t.kind == "F" and t.stage == 0}
  for t in s.tasks:
    if t.kind == "F":  # the latest complete version when it enters stage 0
      assert s.task_version(t) == s.applied(0, entry[(t.minibatch,
                                                      t.microbatch)])
    else:
      assert t.microbatch == 0
      assert s.task_version(t) == s.version(t.minibatch, W - 1, "B")
  last_b = {t.minibatch: t for t in s.tasks if t.kind == "B" and
            t.stage == W - 1}
  for p, t in last_b.items():  # the latest complete version at its start
    assert s.task_version(t) == s.applied(0, t.tick)
  # Backward priority: no stage runs a forward while a backward is ready.
  ends = {(t.minibatch, t.stage, t.kind, t.microbatch): s.end_tick(t)
          for t in s.tasks}
  for t in s.tasks:
    if t.kind != "B":
      continue
    ready = (max(ends[(t.minibatch, t.stage, "F", m)] for m in range(N))
             if t.stage == W - 1 else ends[(t.minibatch, t.stage + 1, "B", 0)])
    between = [u for u in s.tasks if u.stage == t.stage and
               ready <= u.tick < t.tick]
    assert not between, (t, between)


def test_timeprest_matches_seed_003_text():
  # Figure 7(a), W=4, N=2 (paper ids are ours + 1): "mini-batches 3 and 4 use
  # weight updates from mini-batches 1 and 2 during backpropagation ...
  # mini-batch 5 uses updates from mini-batch 3, however, in forward pass the
  # updates from mini-batch 1".
  a = make("timeprest", 4, 2, 8)
  assert [a.version(p, 0, "B") for p in (2, 3, 4)] == [1, 2, 3]
  assert a.version(4, 0, "F", 0) == 1
  # Figure 7(b), W=4, N=4: "micro-batches C and D of mini-batch 3 start with
  # the weights updated by mini-batch 1, different from A and B"; "mini-
  # batches 2 and 3 use the updates from mini-batches 1 and 2 for backward".
  b = make("timeprest", 4, 4, 6)
  assert [b.version(2, 0, "F", m) for m in range(4)] == [0, 0, 1, 1]
  assert [b.version(p, 0, "B") for p in (1, 2)] == [1, 2]
  # §4.2: "backward passes are performed at each third and fifth time point".
  for n, sched in ((2, a), (4, b)):
    ticks = [t.tick for t in sched.tasks if t.stage == 0 and t.kind == "B"]
    assert [y - x for x, y in zip(ticks, ticks[1:])][:3] == [n + 1] * 3


# Zero bubble (Qi et al, ICLR 2024): the backward split into BI and BW.


def _paper_rows(rows):
  """Figure 3's rows (1-based micro-batches, B/W) as our (tick, kind, m)."""
  name = {"F": "F", "B": "BI", "W": "BW"}
  return [{(tick, name[c[0]], int(c[1:]) - 1)
           for tick, c in enumerate(row.split()) if c != "."}
          for row in rows]


def _rows(schedule, kinds=("F", "BI", "BW")):
  return [{(t.tick, t.kind, t.microbatch) for t in schedule.tasks
           if t.stage == k and t.kind in kinds}
          for k in range(schedule.num_stages)]


def test_zb_h1_is_figure_3_top():
  """Transcribed by hand from the paper's Figure 3 (top), p = 4, m = 8."""
  paper = _paper_rows([
      "F1 F2 F3 F4 . . . B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 "
      "B7 W7 B8 W8",
      ". F1 F2 F3 . . B1 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 F8 B6 W5 B7 "
      "W6 B8 W7 W8",
      ". . F1 F2 . B1 F3 B2 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 F8 B7 W5 "
      "B8 W6 W7 W8",
      ". . . F1 B1 F2 B2 F3 B3 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 F8 B8 "
      "W5 W6 W7 W8"])
  assert _rows(make("zb-h1", 4, 8, 1).validate()) == paper


def test_zb_h2_forwards_are_figure_3_bottom():
  """Figure 3 (bottom): the forwards tick for tick; our tails order BI and
  BW differently (forward first, then BI before BW) at the same length."""
  paper = _paper_rows([
      "F1 F2 F3 F4 F5 F6 F7 . . F8",
      ". F1 F2 F3 F4 F5 . F6 . F7 . . F8",
      ". . F1 F2 F3 . F4 . F5 . F6 . F7 . . F8",
      ". . . F1 . F2 . F3 . F4 . F5 . F6 . F7 . . F8"])
  s = make("zb-h2", 4, 8, 1).validate()
  assert _rows(s, kinds=("F",)) == paper
  for k in range(4):  # each stage busy 3M ticks on end, from tick k
    assert s.busy[k:k + 24, k].all() and s.busy[:, k].sum() == 24


def _peak_before_input_gradient(schedule):
  """Per stage, the most micro-batches between their F and their BI's end."""
  ends = {(t.stage, t.minibatch, t.microbatch): schedule.end_tick(t)
          for t in schedule.tasks if t.kind == "BI"}
  peaks = []
  for k in range(schedule.num_stages):
    spans = [(t.tick, ends[(k, t.minibatch, t.microbatch)])
             for t in schedule.tasks if t.stage == k and t.kind == "F"]
    peaks.append(max(sum(a <= tick < b for a, b in spans)
                     for tick in range(schedule.num_ticks)))
  return tuple(peaks)


@FAST
@given(S=st.integers(1, 7), extra=st.integers(0, 5), B=st.integers(1, 3))
def test_zb_h1_matches_table_2(S, extra, B):
  M = S + extra
  s = make("zb-h1", S, M, B).validate()
  one = make("1f1b", S, M, B)
  assert s.num_ticks == theory.zero_bubble_h1_makespan(S, M, B)
  assert s.bubble_fraction == pytest.approx(theory.zero_bubble_h1_bubble(S, M))
  # Idle per stage and minibatch: a third of 1F1B's with a 2-tick backward.
  assert s.num_ticks / B - 3 * M == theory.zero_bubble_bubble_size("zb-h1", S)
  assert 3 * theory.zero_bubble_bubble_size("zb-h1", S) == (
      theory.one_f_one_b_split_makespan(S, M) - 3 * M)
  # 1F1B's peak: S micro-batches, S - s of them before their BI.
  memory = [theory.zero_bubble_activations("zb-h1", S, k) for k in range(S)]
  assert s.max_in_flight == tuple(sum(m) for m in memory) == (S,) * S
  assert _peak_before_input_gradient(s) == tuple(m[0] for m in memory)
  assert max(s.max_in_flight) == max(one.max_in_flight) == S
  assert one.max_in_flight == tuple(
      sum(theory.zero_bubble_activations("1f1b", S, k)) for k in range(S))
  for t in s.tasks:  # synchronous: a flush per minibatch
    assert s.task_version(t) == t.minibatch
  assert s.stash_depth == (1,) * S and s.staleness == (0,) * B


@FAST
@given(S=st.integers(1, 6), extra=st.integers(0, 4), B=st.integers(1, 3))
def test_zb_h2_matches_table_2(S, extra, B):
  M = 2 * S - 1 + extra
  s = make("zb-h2", S, M, B).validate()
  assert s.num_ticks == theory.zero_bubble_h2_makespan(S, M, B)
  assert s.bubble_fraction == pytest.approx(
      theory.zero_bubble_h2_bubble(S, M, B))
  memory = [theory.zero_bubble_activations("zb-h2", S, k) for k in range(S)]
  assert s.max_in_flight == tuple(sum(m) for m in memory) == (2 * S - 1,) * S
  assert _peak_before_input_gradient(s) == tuple(m[0] for m in memory)
  for k in range(S):  # the parallelogram: no idle tick from k to 3MB + k
    assert s.busy[k:k + 3 * M * B, k].all()
  for t in s.tasks:
    assert s.task_version(t) == t.minibatch
  assert s.stash_depth == (1,) * S and s.staleness == (0,) * B


@FAST
@given(S=st.integers(1, 7), extra=st.integers(-1, 4), B=st.integers(2, 8))
def test_zb_async_versions_staleness_and_memory(S, extra, B):
  M = max(1, S + extra)
  s = make("zb-async", S, M, B).validate() if extra >= 0 else (
      sp.schedules.make("zb-async", num_stages=S, num_microbatches=M,
                        num_minibatches=B).validate())
  for t in s.tasks:  # 2BW's version map; BI and BW read their F's version
    assert s.task_version(t) == theory.pipedream_2bw_version(t.minibatch)
    assert s.task_version(t) == s.version(t.minibatch, t.stage, "F",
                                          t.microbatch)
  assert s.staleness == tuple(min(p, 1) for p in range(B))
  assert s.stash_depth == (theory.PIPEDREAM_2BW_VERSIONS,) * S
  memory = [theory.zero_bubble_activations("zb-h1", S, k) for k in range(S)]
  if M >= S:  # ZB-H2's ticks at ZB-H1's memory
    assert s.num_ticks == 3 * M * B + S - 1
    assert s.max_in_flight == (S,) * S
    assert _peak_before_input_gradient(s) == tuple(m[0] for m in memory)
  else:  # M = S - 1 stalls once, in the fill
    assert s.num_ticks <= 3 * M * B + S


def test_zb_async_rejects_too_few_microbatches():
  with pytest.raises(ValueError, match=r"^num_microbatches=2 is invalid for "
                     r"zb-async with 4 stages; it must be >= num_stages - 1$"):
    sp.schedules.make("zb-async", num_stages=4, num_microbatches=2)


@pytest.mark.parametrize("name", sp.schedules.names())
@pytest.mark.parametrize("S,M", [(3, 2), (4, 4), (4, 9), (5, 3)])
def test_weight_gradients_grouped_by_minibatch(name, S, M):
  """A stage applies minibatch p's update before any backward task of p+1
  starts there: the executor keeps one gradient accumulator per stage."""
  s = make(name, S, M, 5)
  for t in s.tasks:
    if s.kind(t).runs_backward and t.minibatch > 0:
      assert s.update_ticks[(t.stage, t.minibatch - 1)] < t.tick, (name, t)


def test_split_backward_held_once():
  """F, BI, BW of one micro-batch: held once, from F's start to BW's end."""
  tasks = (sp.schedules.Task(0, 0, "F", 0, 0),
           sp.schedules.Task(1, 0, "BI", 0, 0),
           sp.schedules.Task(2, 0, "BW", 0, 0))
  s = sp.schedules.Schedule("hand", 1, 1, 1, tasks,
                            {(0, 0, t.kind, 0): 0 for t in tasks}).validate()
  assert s.held == {(0, 0, 0): (0, 3)}
  assert s.max_in_flight == (1,) and s.num_ticks == 3


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-async"])
@pytest.mark.parametrize("S,M", [(2, 3), (4, 8), (5, 5)])
def test_split_max_in_flight_brute_force(name, S, M):
  """Counted tick by tick from the tasks: a micro-batch is in flight from its
  F's start until its BW ends, whatever its BI does in between."""
  s = make(name, S, M, 3)
  start, end = {}, {}
  for t in s.tasks:
    key = (t.stage, t.minibatch, t.microbatch)
    if t.kind == "F":
      start[key] = t.tick
    if t.kind == "BW":
      end[key] = s.end_tick(t)
  peaks = tuple(max(sum(start[key] <= tick < end[key] for key in start
                        if key[0] == k) for tick in range(s.num_ticks))
                for k in range(S))
  assert s.max_in_flight == peaks
