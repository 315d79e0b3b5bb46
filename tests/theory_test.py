"""Closed forms against independent brute-force computations."""


from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from stalepipe import schedules
from stalepipe import theory

FAST = settings(max_examples=25, deadline=None)


def gpipe_grid_bubble(S, M):
  """Idle slots of a NumPy rendering of GPipe's fill-and-drain timeline."""
  T = 2 * (M + S - 1)
  grid = np.zeros((S, T), dtype=bool)
  for s in range(S):
    grid[s, s:s + M] = True  # forwards
    grid[s, T - s - M:T - s] = True  # backwards, mirrored
  return 1 - grid.mean()


@FAST
@given(S=st.integers(1, 16), M=st.integers(1, 32))
def test_gpipe_bubble(S, M):
  assert theory.gpipe_bubble(S, M) == pytest.approx(gpipe_grid_bubble(S, M))


def wsp_brute_force(D, s_local):
  """The most missing updates over minibatches, from WSP's clock rules.

  Minibatch p (0-based) of wave w = p // (s+1) starts once minibatch p - N_m
  is done; the first s minibatches of a wave therefore start at local clock
  w - 1, the last at clock w. At clock c the weights hold waves 0..c-D-1
  (seed 001 §5).
  """
  wave = s_local + 1
  worst = 0
  for p in range(wave * (D + 6)):
    w, i = divmod(p, wave)
    clock = w if i == wave - 1 else max(w - 1, 0)
    covered = max(0, clock - D) * wave
    worst = max(worst, p - covered)
  return worst


@pytest.mark.parametrize("D", range(5))
@pytest.mark.parametrize("s_local", range(1, 7))
def test_wsp_global_staleness(D, s_local):
  assert theory.wsp_global_staleness(D, s_local) == wsp_brute_force(D, s_local)


def test_wsp_paper_example():
  assert theory.wsp_global_staleness(0, 3) == 6  # seed 001 §5, Figure 3
  assert theory.wsp_local_staleness(4) == 3


def test_hetpipe_version_is_updates_0_to_p_minus_nm():
  for n_m in range(1, 6):
    for p in range(20):
      assert theory.hetpipe_version(p, n_m) == len(range(0, p - n_m + 1))


def timeprest_steady_brute_force(W, N):
  """Smallest k with backwards N+1 ticks apart, W ticks long, not overlapping."""
  k = 1
  while k * (N + 1) < W:
    k += 1
  return k


@pytest.mark.parametrize("W", range(2, 13))
@pytest.mark.parametrize("N", range(1, 9))
def test_timeprest_closed_forms(W, N):
  steady = theory.timeprest_steady_version_difference(W, N)
  assert steady == timeprest_steady_brute_force(W, N)
  assert (steady == 1) == (W <= N + 1) == theory.timeprest_single_sequence(
      W, N)
  paper = theory.timeprest_version_difference(W, N)
  if N >= 2:  # the paper's domain (eq. 4): its v = 1 condition holds
    assert (paper == 1) == theory.timeprest_single_sequence(W, N)


def test_timeprest_paper_figures():
  # Figure 7(a) W=4, N=2: v = 2; 7(b) N=4: v = 1; Fig. 9(a) W=3, N=3: v = 1;
  # Fig. 10 W=5, N=3: v = 2.
  for W, N, v in ((4, 2, 2), (4, 4, 1), (3, 3, 1), (5, 3, 2)):
    assert theory.timeprest_version_difference(W, N) == v
    assert theory.timeprest_steady_version_difference(W, N) == v


def test_pipedream_forms_match_the_schedules():
  for S in range(1, 6):
    s = schedules.make("pipedream", num_stages=S, num_microbatches=1,
                       num_minibatches=4 * S)
    assert list(s.stash_depth) == [theory.pipedream_stash_depth(S, st)
                                   for st in range(S)]
    measured = [max(t.minibatch - s.task_version(t) for t in s.tasks
                    if t.stage == st and t.kind == "B") for st in range(S)]
    assert measured == [theory.pipedream_staleness(S, st) for st in range(S)]
  two = schedules.make("2bw", num_stages=3, num_microbatches=3,
                       num_minibatches=6)
  assert [two.version(p, 0, "F") for p in range(5)] == [
      theory.pipedream_2bw_version(p) for p in range(5)]
  assert max(two.stash_depth) == theory.PIPEDREAM_2BW_VERSIONS


def zero_bubble_grid_makespan(S, M, extra_warmup):
  """Ticks of a NumPy rendering of Qi et al's Figure 3 layouts, unit costs.

  Stage s runs its 3M tasks back to back from tick s (the last stage never
  waits), except that every stage but the last first waits for its first
  input gradient: stage s starts S - s + extra_warmup forwards, then idles
  until the BI of micro-batch 0 arrives at tick 2(S - 1) - s + 1, unless the
  warm-up forwards already reach it (ZB-H2: extra_warmup = S - s - 1).
  """
  end = 0
  for s in range(S):
    warm = min(M, S - s + extra_warmup(s))
    first_bi = 2 * (S - 1) - s + 1
    idle = max(0, first_bi - (s + warm))
    grid = np.zeros(s + 3 * M + idle + 1, dtype=bool)
    grid[s:s + warm] = True
    grid[s + warm + idle:s + 3 * M + idle] = True
    end = max(end, int(np.flatnonzero(grid)[-1]) + 1)
  return end


@FAST
@given(S=st.integers(1, 10), extra=st.integers(0, 10))
def test_zero_bubble_makespans(S, extra):
  M = 2 * S - 1 + extra
  assert theory.zero_bubble_h1_makespan(S, M) == zero_bubble_grid_makespan(
      S, M, lambda s: 0)
  assert theory.zero_bubble_h2_makespan(S, M) == zero_bubble_grid_makespan(
      S, M, lambda s: S - s - 1)
  for B in (1, 3):  # Table 2's idle time per stage and minibatch
    assert theory.zero_bubble_h1_makespan(S, M, B) == B * (
        3 * M + theory.zero_bubble_bubble_size("zb-h1", S))
    assert theory.one_f_one_b_split_makespan(S, M, B) == B * (
        3 * M + theory.zero_bubble_bubble_size("1f1b", S))
    assert theory.zero_bubble_bubble_size("zb-h2", S) == 0
  h1 = theory.zero_bubble_h1_makespan(S, M)
  assert theory.zero_bubble_h1_bubble(S, M) == pytest.approx(1 - 3 * M / h1)
  assert theory.gpipe_bubble(S, M) == pytest.approx(
      1 - 3 * M / theory.one_f_one_b_split_makespan(S, M))
  for s in range(S):  # Table 2's peaks, in units of M_B with M_W <= M_B
    b1, w1 = theory.zero_bubble_activations("zb-h1", S, s)
    b2, w2 = theory.zero_bubble_activations("zb-h2", S, s)
    assert (b1 + w1, b2 + w2) == (S, 2 * S - 1)
    assert b1 == theory.zero_bubble_activations("1f1b", S, s)[0] == S - s


@pytest.mark.parametrize("fn,args", [
    (theory.wsp_global_staleness, (-1, 3)),
    (theory.timeprest_version_difference, (4, 0.5)),
    (theory.hetpipe_version, (3, -2)),
    (theory.zero_bubble_h1_makespan, (4, 3)),
    (theory.zero_bubble_h2_makespan, (4, 6)),
    (theory.one_f_one_b_split_makespan, (4, 8, 0)),
    (theory.zero_bubble_bubble_size, ("gpipe", 4)),
    (theory.zero_bubble_bubble_size, ("zb-h1", 4, -1.0)),
    (theory.zero_bubble_activations, ("zb-h2", 4, 4)),
])
def test_bad_input_raises(fn, args):
  with pytest.raises(ValueError, match="is invalid"):
    fn(*args)
