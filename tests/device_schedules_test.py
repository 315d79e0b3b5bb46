"""Device-level schedules: the sources' orders, their closed forms, validate;
asynchronous PipeDream on chunks: its version maps, stash and bubble.

Each of interleaved-1f1b, looped-bfs, zb-v and dualpipev is compared, device
by device, with the order of actions its source gives each rank
(`tests/_sources/pipelining.py`: torch.distributed.pipelining's per-rank
generators and DeepSeek's `DualPipeV.step`), then checked against the closed
forms its paper states (unit F, BI, BW; a full backward of DualPipeV two).
"""

import dataclasses
import math

import pytest

import stalepipe as sp
from stalepipe import theory
from tests._sources import pipelining

KIND = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
SHAPES = [(2, 2, 4), (4, 2, 8)]  # (P, v, M) the issue names


LOOP = ("interleaved-1f1b", "looped-bfs", "pipedream-interleaved")
ASYNC = ("pipedream-interleaved", "pipedream-v")  # one micro-batch each


def make(name, P, M, B=1, v=2, **kw):
  if name in LOOP:
    kw["num_devices"] = P
  if name in ASYNC:
    M = 1
  return sp.schedules.make(name, num_stages=v * P, num_microbatches=M,
                           num_minibatches=B, **kw).validate()


def device_order(schedule, d, minibatch=0):
  """Device d's units in order: an action, or an overlapped (F, B) pair."""
  pairs = {b: f for f, b in schedule.overlapped}
  units = []
  for t in schedule.tasks:
    if schedule.device(t) != d or t.minibatch != minibatch:
      continue
    action = (t.stage, t.kind, t.microbatch)
    if t in pairs:
      f = pairs[t]
      units.append(((f.stage, f.kind, f.microbatch), action))
    elif not any(t == f for f in pairs.values()):
      units.append(action)
  return units


def source_order(ops):
  """The source's actions in our kinds, overlapped units kept as pairs."""
  def ours(a):
    return (a[0], KIND[a[1]], a[2])
  return [tuple(ours(a) for a in op) if isinstance(op[0], tuple) else ours(op)
          for op in ops]


@pytest.mark.parametrize("P,v,M", SHAPES + [(4, 3, 8), (4, 2, 3), (3, 2, 9),
                                            (4, 2, 10)])
def test_interleaved_1f1b_is_torchs_order(P, v, M):
  s = make("interleaved-1f1b", P, M, v=v)
  for d in range(P):
    assert device_order(s, d) == source_order(
        pipelining.interleaved_1f1b(d, v, P, M)), d


@pytest.mark.parametrize("P,v,M", SHAPES + [(4, 3, 5), (3, 2, 2)])
def test_looped_bfs_is_torchs_order(P, v, M):
  s = make("looped-bfs", P, M, v=v)
  for d in range(P):
    assert device_order(s, d) == source_order(
        pipelining.looped_bfs(d, v, P, M)), d


@pytest.mark.parametrize("P,v,M", SHAPES + [(3, 2, 7), (4, 2, 5), (1, 2, 3)])
def test_zb_v_is_torchs_order(P, v, M):
  s = make("zb-v", P, M)
  for d in range(P):
    assert device_order(s, d) == source_order(pipelining.zb_v(d, P, M)), d


@pytest.mark.parametrize("P,v,M", SHAPES + [(3, 2, 7), (4, 2, 11), (1, 2, 2)])
def test_dualpipev_is_deepseeks_and_torchs_order(P, v, M):
  s = make("dualpipev", P, M)
  for d in range(P):
    ours = device_order(s, d)
    assert ours == source_order(pipelining.dualpipev_deepseek(d, P, M)), d
    assert ours == source_order(pipelining.dualpipev_torch(d, P, M)), d


def idle(schedule):
  """Per device, the ticks it does nothing."""
  return tuple(int(x) for x in schedule.num_ticks
               - schedule.device_busy.sum(axis=0))


@pytest.mark.parametrize("P,v,M", [(2, 2, 4), (4, 2, 8), (4, 3, 8),
                                   (4, 2, 16), (3, 4, 6), (1, 3, 2)])
def test_interleaved_1f1b_closed_forms(P, v, M):
  """Narayanan et al §2.2.2: with M a multiple of P, (m + p - 1)(t_f + t_b)
  / v per device, a chunk's forward and backward one tick each: 2(vM + P -
  1) ticks, a bubble of (P - 1) / (vM) of the ideal 2vM; device d holds at
  most its warm-up (Megatron's, rounds of P micro-batches) plus one
  micro-batch, (v - 1) P + 2(P - 1 - d) + 1, at most vM."""
  s = make("interleaved-1f1b", P, M, v=v)
  assert s.num_ticks == theory.interleaved_1f1b_makespan(P, v, M)
  assert idle(s) == (2 * (P - 1),) * P
  assert (s.num_ticks - 2 * v * M) / (2 * v * M) == pytest.approx(
      theory.interleaved_1f1b_bubble(P, v, M))
  assert s.device_max_in_flight == tuple(
      min((v - 1) * P + 2 * (P - 1 - d) + 1, v * M) for d in range(P))


@pytest.mark.parametrize("P,v,M", [(2, 2, 4), (4, 2, 8), (4, 3, 5)])
def test_looped_bfs_holds_every_microbatch(P, v, M):
  s = make("looped-bfs", P, M, v=v)
  assert s.device_max_in_flight == (v * M,) * P
  assert s.num_ticks == 2 * (v * M + P - 1)


@pytest.mark.parametrize("P,M", [(1, 2), (2, 4), (3, 6), (3, 7), (4, 8),
                                 (4, 16), (6, 13)])
def test_zb_v_closed_forms(P, M):
  """Qi et al §6 with T_F = T_B = T_W: no bubble but the fill, 3vM + P - 1
  ticks (v = 2), and 2P chunk micro-batches held on every device (1F1B's
  P whole-stage ones) once M >= 2P."""
  s = make("zb-v", P, M)
  assert s.num_ticks == theory.zero_bubble_v_makespan(P, M)
  assert idle(s) == (P - 1,) * P
  if M >= 2 * P:
    assert s.device_max_in_flight == (2 * P,) * P
  assert max(s.device_max_in_flight) <= 2 * P


@pytest.mark.parametrize("P,M", [(1, 2), (2, 4), (3, 6), (3, 7), (4, 8),
                                 (4, 16), (5, 10), (8, 16)])
def test_dualpipev_closed_forms(P, M):
  """DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1,
  with PP = 2P stages, F = W = 1, a full backward B = 2 and an overlapped
  unit F&B = max(F, B) = 2: P - 1 idle ticks on the busiest device."""
  s = make("dualpipev", P, M)
  f_and_b, b, w = 2, s.durations["B"], s.durations["BW"]
  assert max(idle(s)) == theory.dualpipev_bubble(P, f_and_b, b, w)
  assert idle(s) == tuple(min(d + 1, P - 1) for d in range(P))
  assert s.device_max_in_flight == (2 * P + 1,) * P
  assert s.num_ticks == 4 * M + 3 * P
  for f, bw in s.overlapped:
    assert (f.kind, bw.kind, f.tick) == ("F", "B", bw.tick)
    assert s.device(f) == s.device(bw) and f.stage != bw.stage


@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs", "zb-v",
                                  "dualpipev"])
@pytest.mark.parametrize("P,M", [(2, 4), (3, 6)])
def test_synchronous_and_repeated_per_minibatch(name, P, M):
  """A flush per minibatch: version p everywhere, one version per stage, and
  B minibatches run the window B times, each after the last's update."""
  one, three = make(name, P, M), make(name, P, M, B=3)
  for t in three.tasks:
    assert three.task_version(t) == t.minibatch
  assert three.stash_depth == (1,) * (2 * P)
  assert three.device_stash_depth == (2,) * P
  assert three.staleness == (0, 0, 0)
  assert three.num_ticks <= 3 * one.num_ticks
  for p in range(3):
    assert [device_order(three, d, p) for d in range(P)] == [
        device_order(one, d) for d in range(P)]
  if name == "zb-v":  # a stage starts p + 1 while others finish p's BW
    with pytest.raises(ValueError, match="not yet finished"):
      three.together()
  else:  # every stage finishes p's gradient before any reads p's update
    three.together()


def test_validate_names_a_device_clash():
  s = make("interleaved-1f1b", 2, 4)
  a = next(t for t in s.tasks if t.stage == 0 and t.kind == "B")
  clash = next(t for t in s.tasks if t.stage == 2 and t.kind == "F"
               and t.tick > a.tick)
  moved = clash._replace(tick=a.tick)
  tasks = tuple(sorted([moved if t == clash else t for t in s.tasks],
                       key=lambda t: (t.tick, t.stage)))
  with pytest.raises(ValueError, match=rf"^Task\(tick={a.tick}, stage=2, "
                     rf"kind='F'.* clashes with .*stage=0.* on device 0 at "
                     rf"tick {a.tick}$"):
    dataclasses.replace(s, tasks=tasks).validate()


def test_validate_accepts_only_declared_overlaps():
  s = make("dualpipev", 2, 4)
  with pytest.raises(ValueError, match="clashes with"):
    dataclasses.replace(s, overlapped=()).validate()
  f, b = s.overlapped[0]
  with pytest.raises(ValueError, match="overlapped pair .* is invalid"):
    dataclasses.replace(s, overlapped=((b, f),) + s.overlapped[1:]).validate()


def test_stage_level_schedules_have_no_devices():
  s = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2)
  assert s.placed is None
  with pytest.raises(ValueError, match="has no placement"):
    s.device(s.tasks[0])


@pytest.mark.parametrize("name,kw,message", [
    ("interleaved-1f1b", {"num_stages": 8, "num_microbatches": 9,
                          "num_devices": 4},
     "^num_microbatches=9 is invalid for interleaved-1f1b with 4 devices; it "
     r"must be a multiple of max\(1, M // P\) = 2$"),
    ("looped-bfs", {"num_stages": 6, "num_microbatches": 2, "num_devices": 4},
     "^num_devices=4 is invalid for looped-bfs with 6 stages; valid: a "
     "divisor of 6$"),
    ("zb-v", {"num_stages": 5, "num_microbatches": 4},
     r"^num_stages=5 is invalid for zb-v; it must be even"),
    ("dualpipev", {"num_stages": 8, "num_microbatches": 7},
     "^num_microbatches=7 is invalid for dualpipev with 8 stages; it must be "
     ">= num_stages = 8$"),
])
def test_refusals(name, kw, message):
  with pytest.raises(ValueError, match=message):
    sp.schedules.make(name, **kw)


@pytest.mark.parametrize("name", sp.schedules.DEVICE_LEVEL)
def test_tile_equals_building_directly(name):
  """Long streams (the trainer's observed staleness) tile the steady state:
  the same tasks, versions and overlapped units as building them."""
  short = make(name, 2, 4, B=12)
  tiled, direct = sp.sim.tile(short, 31), short.with_minibatches(31)
  assert tiled.tasks == direct.tasks
  assert dict(tiled.versions) == dict(direct.versions)
  assert sorted(tiled.overlapped) == sorted(direct.overlapped)
  assert (tiled.placement, tiled.num_devices) == (short.placement, 2)
  tiled.validate()


def d_v(P, s):
  """pipedream-v's d_s: minibatches chunk s misses (`pipedream_v.py`)."""
  return P - 1 - s // 2 if P % 2 else P - math.ceil(s / 2)


def missed(schedule):
  """Per stage, p - version of a late minibatch p (the steady state)."""
  p = schedule.num_minibatches - 1
  return [p - schedule.version(p, s, "F") for s in range(schedule.num_stages)]


@pytest.mark.parametrize("P", range(1, 13))
def test_pipedream_v_version_map_stash_and_bubble(P):
  """Every task of minibatch p on chunk s reads max(0, p - d_s), its
  backward its forward's version; every device keeps P + 2 versions (P
  even) or P + 1 (P odd); no device idles in the steady state."""
  s = make("pipedream-v", P, 1, B=6 * P)
  for t in s.tasks:
    assert s.task_version(t) == max(0, t.minibatch - d_v(P, t.stage)), t
  assert s.device_stash_depth == (P + 2 - P % 2,) * P
  assert s.max_in_flight[0] == P + 1 - P % 2
  entry = {t.minibatch: t.tick for t in s.tasks if (t.stage, t.kind) == (0, "F")}
  assert s.device_busy[entry[3 * P]:entry[4 * P]].all()
  assert entry[1] - entry[0] == 4


def d_loop(P, v, s):
  """pipedream-interleaved's d_s (`pipedream_interleaved.py`)."""
  wrap = next(w for w in range(2 * v) if (P + w) % 2 == 0
              and math.gcd((P + w) // 2, v) == 1) if min(P, v) > 1 else 0
  return (2 * v * P - 1 - 2 * s + 2 * wrap * (v - 1 - s // P)) // (2 * v)


@pytest.mark.parametrize("P", range(1, 9))
@pytest.mark.parametrize("v", range(1, 5))
def test_pipedream_interleaved_version_map_and_bubble(P, v):
  """Every task of minibatch p on chunk s reads max(0, p - d_s); P - 1 -
  floor(s / v) where no wait is needed (P even, gcd(P / 2, v) = 1); a
  minibatch every 2v ticks and no device idles in the steady state."""
  s = make("pipedream-interleaved", P, 1, B=4 * P + 4, v=v)
  d = [d_loop(P, v, k) for k in range(v * P)]
  for t in s.tasks:
    assert s.task_version(t) == max(0, t.minibatch - d[t.stage]), t
  if P % 2 == 0 and math.gcd(P // 2, v) == 1:
    assert d == [P - 1 - k // v for k in range(v * P)]
  entry = {t.minibatch: t.tick for t in s.tasks if (t.stage, t.kind) == (0, "F")}
  assert entry[1] - entry[0] == 2 * v
  assert s.device_busy[entry[2 * P + 2]:entry[3 * P + 2]].all()


@pytest.mark.parametrize("P", [4, 8])
def test_the_v_balances_the_stash_that_consecutive_pipedream_does_not(P):
  """Stage-level PipeDream keeps S - s versions on stage s: folded two a
  device, 2S - 1 - 4d on device d of the consecutive placement, S + 1 on
  every device of the V; pipedream-v keeps P + 2 everywhere."""
  S = 2 * P
  stage = sp.schedules.make("pipedream", num_stages=S, num_microbatches=1,
                            num_minibatches=4 * S)
  assert stage.stash_depth == tuple(S - s for s in range(S))
  for name, want in (("consecutive", [2 * S - 1 - 4 * d for d in range(P)]),
                     ("v", [S + 1] * P)):
    placed = sp.pipeline.placement.make(name, S, P)
    assert [sum(stage.stash_depth[k] for k in placed.stages[d])
            for d in range(P)] == want
  assert max(make("pipedream-v", P, 1, B=4 * S).device_stash_depth) == P + 2


def test_pipedream_v_with_fewer_in_flight_stretches_the_period():
  """K below the P + 1 that keep the devices busy: a minibatch every 6
  ticks (P = 4), at most K in flight; K above changes nothing."""
  full = make("pipedream-v", 4, 1, B=24)
  assert make("pipedream-v", 4, 1, B=24, max_in_flight=9).tasks == full.tasks
  s = make("pipedream-v", 4, 1, B=24, max_in_flight=4)
  entry = sorted(t.tick for t in s.tasks if (t.stage, t.kind) == (0, "F"))
  assert {b - a for a, b in zip(entry, entry[1:])} == {6}
  assert max(s.max_in_flight) <= 4
  assert missed(s) == [2, 2, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("name,kw,message", [
    ("pipedream-v", {"num_stages": 8, "num_microbatches": 2},
     "^num_microbatches=2 is invalid for pipedream-v; valid: 1 "),
    ("pipedream-interleaved", {"num_stages": 8, "num_microbatches": 1,
                               "num_devices": 3},
     "^num_devices=3 is invalid for pipedream-interleaved with 8 stages"),
    ("pipedream-v", {"num_stages": 8, "num_microbatches": 1,
                     "max_in_flight": 0},
     "^max_in_flight=0 is invalid for pipedream-v; it must be an integer")])
def test_pipedream_on_chunks_refusals(name, kw, message):
  with pytest.raises(ValueError, match=message) as e:
    sp.schedules.make(name, **kw)
  assert "\n" not in str(e.value)


def test_the_simulator_times_a_device_level_schedule_on_its_devices():
  """Its chunks share the schedule's P devices (tests/sim_device_test.py), so
  a cluster of one device a stage is refused."""
  s = make("zb-v", 2, 4, B=2)
  with pytest.raises(ValueError, match=r"^cluster has 4 stages \(devices a "
                     r"pipeline\); valid: 2, the devices of device-level "
                     r"schedule 'zb-v' \(4 stages, v placement\)$"):
    sp.sim.simulate(s, sp.sim.Cluster.grid(1, 4), sp.sim.StageCosts.uniform(4))
