"""The lanes' tick (`pipeline/lanes.py`) trains what the slots' tick trains.

A device-level schedule runs at most one task a device a tick (DualPipeV's
overlapped pair: two), so a device runs lanes over its busy slots only. The
lane plan is checked against the schedule's own tasks, and every run below
against the same pipeline with `tick="slots"`, bit for bit: the losses of
every window and every leaf of the state (the buffers' scratch rows aside). The oracle and unpipelined
comparisons of these schedules (`device_schedules_executor_test.py`) run
through the lanes too, as `tick="auto"` picks them there.
"""

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import lanes
from stalepipe.pipeline import program as program_lib
from tests.device_schedules_executor_test import _make, _windows


@pytest.mark.parametrize("name,P,devices,width", [
    ("interleaved-1f1b", 2, 2, 1), ("zb-v", 2, 2, 1),
    ("dualpipev", 2, 2, 2), ("pipedream-v", 4, 4, 1),
    ("interleaved-1f1b", 4, 2, 2)])
def test_the_plan_runs_each_busy_slot_in_one_lane(name, P, devices, width):
  """Every stage with a task or an update in a tick of a window's table has
  its slot in one lane of its device, in slot order; the lanes are as many
  as the schedule's most tasks on one device in one tick."""
  schedule = _make(name, P, 4, B=1)
  placement = sp.pipeline.placement.for_schedule(schedule, devices)
  program = program_lib.compile_program(schedule)
  got = lanes.plan(program, placement.stages)
  per_tick = {}
  for t in schedule.tasks:
    key = (t.tick, placement.where(t.stage)[0])
    per_tick[key] = per_tick.get(key, 0) + 1
  assert got.shape[-1] == width == max(per_tick.values())
  tables = program.tables
  for k, t in np.ndindex(*got.shape[:2]):
    want = {d: [] for d in range(devices)}
    for s in range(schedule.num_stages):
      if tables.kind[k, t, s] or tables.update[k, t, s] == 1:
        d, j = placement.where(s)
        want[d].append(j)
    for d in range(devices):
      assert list(got[k, t, d][got[k, t, d] >= 0]) == sorted(want[d])


def _run(name, D, P, devices, tick, optimizer, remat="recompute",
         axis_types=None, drain=True):
  schedule = _make(name, P, 4)
  staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                           schedule.num_stages)
  mesh = jax.make_mesh((D, devices), ("data", "stage"),
                       devices=jax.devices()[:D * devices],
                       axis_types=axis_types)
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, mesh, remat=remat, tick=tick)
  state, losses = pipe.init(staged.stage_params), []
  for x, y in _windows(3, 2, schedule.num_microbatches, 4 * D):
    state, metrics = pipe.step(state, x, y)
    losses.append(float(metrics["loss"]))
  if drain:  # its tables leave tasks out of the program's
    state, metrics = pipe.drain(state)
    losses.append(float(metrics["loss"]))
  return pipe, losses, _live(state)


def _live(state):
  """Every leaf of `state` but the buffers' scratch rows (index C: what
  arrives for no stage of a device; each tick writes it its own way)."""
  return jax.tree.leaves(state._replace(buffers=jax.tree.map(
      lambda v: v[:, :, :-1], state.buffers)))


def _dc():  # compensates with the stashed version (`stale_params`)
  return optax.chain(sp.optim.dc_asgd_ema(1.0), optax.sgd(0.3, 0.9))


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,D,P,devices,optimizer,remat,lanes_", [
    # one device: 2 lanes over 4 slots
    pytest.param("interleaved-1f1b", 1, 2, 1, lambda: optax.adam(1e-2),
                 "recompute", 2, marks=_SLOW),
    # the quick case: the V on 2 devices, windows only (no drain)
    ("pipedream-v", 1, 2, 2, lambda: optax.sgd(0.1), "recompute", 1),
    # the V's hops run both ways; stale reads and compensation
    pytest.param("pipedream-v", 1, 4, 4, _dc, "recompute", 1, marks=_SLOW),
    # a split backward: the residual and op-cotangent rows, replicas
    pytest.param("zb-v", 2, 2, 2, lambda: optax.adam(1e-2), "residuals", 1,
                 marks=_SLOW),
    pytest.param("pipedream-interleaved", 1, 2, 2,
                 lambda: sp.optim.SpecTrain(optax.sgd(0.3, 0.9),
                                            staleness="minibatch"),
                 "recompute", 1, marks=_SLOW),
    pytest.param("looped-bfs", 2, 4, 4, lambda: optax.adam(1e-2),
                 "residuals", 1, marks=_SLOW),
    pytest.param("interleaved-1f1b", 2, 4, 4, lambda: optax.sgd(0.1),
                 "recompute", 1, marks=_SLOW)])
def test_lanes_train_what_the_slots_train_bit_for_bit(
    name, D, P, devices, optimizer, remat, lanes_):
  drain = not (name == "pipedream-v" and P == 2)  # the quick case: windows
  lane, lane_losses, lane_state = _run(name, D, P, devices, "lanes",
                                       optimizer(), remat, drain=drain)
  slots, slot_losses, slot_state = _run(name, D, P, devices, "slots",
                                        optimizer(), remat, drain=drain)
  assert (lane.lanes, slots.lanes) == (lanes_, None)
  np.testing.assert_array_equal(lane_losses, slot_losses)  # NaN: no drain
  for a, b in zip(lane_state, slot_state, strict=True):
    np.testing.assert_array_equal(a, b)


@_SLOW
def test_lanes_under_auto_axes_equal_explicit_ones():
  auto = (jax.sharding.AxisType.Auto,) * 2
  _, auto_losses, auto_state = _run("pipedream-v", 1, 2, 2, "lanes",
                                    optax.sgd(0.1), axis_types=auto)
  _, losses, state = _run("pipedream-v", 1, 2, 2, "lanes", optax.sgd(0.1))
  np.testing.assert_array_equal(auto_losses, losses)
  for a, b in zip(auto_state, state, strict=True):
    np.testing.assert_array_equal(a, b)


def test_auto_picks_lanes_where_a_device_has_16_slots_a_lane():
  def pick(name, P, devices, tick="auto", v=2, **kwargs):
    schedule = _make(name, P, 4, v=v)
    staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                             schedule.num_stages)
    mesh = jax.make_mesh((1, devices), ("data", "stage"),
                         devices=jax.devices()[:devices])
    return executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                             optax.sgd(0.1), mesh, tick=tick, **kwargs).lanes

  assert pick("interleaved-1f1b", 2, 2) is None  # 2 slots, 1 lane
  assert pick("interleaved-1f1b", 2, 1, v=16) == 2  # 32 slots, 2 lanes
  assert pick("interleaved-1f1b", 2, 2, tick="lanes") == 1
  assert pick("dualpipev", 2, 2, tick="lanes") == 2  # the overlapped pair
  with pytest.raises(ValueError, match="tick 'lanes' is invalid with "
                     "optimizer_scope 'model'"):
    pick("interleaved-1f1b", 2, 2, tick="lanes",
         optimizer_scope="model")
  with pytest.raises(ValueError, match="tick 'fast' is invalid; valid: "
                     "auto, slots, lanes"):
    pick("interleaved-1f1b", 2, 2, tick="fast")


def test_lanes_refuse_one_slot_and_a_sharded_stage():
  with pytest.raises(ValueError, match="with one slot a device"):
    lanes.check("lanes", 1, False, False, np.zeros((1, 1, 1, 1)))
  with pytest.raises(ValueError, match="sharded over 'fsdp'"):
    lanes.check("lanes", 2, True, False, np.zeros((1, 1, 1, 1)))
  assert not lanes.check("auto", 2, True, False, np.zeros((1, 1, 1, 1)))
