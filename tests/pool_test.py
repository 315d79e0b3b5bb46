"""A device's weight versions pooled in one stash (`pipeline/pool.py`).

The pool holds the versions a device's stages keep at once, the schedule's
per-device figure (`Schedule.device_stash_depth`), where one ring a slot
holds the sum of each slot's deepest. Checked here: the pool's planned size
against that figure (computed by the schedule from its tasks, not by the
planner), and every run below against the same pipeline with one ring a
slot, bit for bit: the losses of every window and of a drain, the latest
weights and updates of every stage, and a forward-only evaluation.
"""

import jax
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import program as program_lib
from tests.device_schedules_executor_test import _make, _windows


def _figure(schedule, placement):
  """The most versions one device keeps at once, from the schedule over 48
  minibatches (its stages' live versions summed tick by tick)."""
  long = schedule.with_minibatches(48)
  if long.num_devices:
    return max(long.device_stash_depth)
  return max(sum(long.stash_depth[s] for s in stages)
             for stages in placement.stages)


@pytest.mark.parametrize("name,P,devices,placement,pool,rings", [
    ("pipedream-v", 4, 4, None, 6, 8),
    ("pipedream-v", 3, 3, None, 4, 5),
    ("pipedream-v", 8, 8, None, 10, 14),
    ("pipedream-interleaved", 4, 4, None, 7, 7),
    ("pipedream", 8, 4, "v", 9, 12),
    ("pipedream", 8, 4, "consecutive", 15, 15),
    ("pipedream", 8, 4, "loop", 12, 12)])
def test_the_pool_holds_the_schedules_figure(name, P, devices, placement,
                                             pool, rings):
  schedule = (sp.schedules.make(name, num_stages=P, num_microbatches=1)
              if name == "pipedream" else _make(name, P, 1, B=1))
  where = sp.pipeline.placement.for_schedule(schedule, devices, placement)
  slots = program_lib.compile_program(schedule,
                                      ring_groups=where.stages.T)
  pooled = program_lib.compile_program(schedule, ring_groups=where.stages.T,
                                       pools=where.stages)
  assert pooled.pool_size == pool == _figure(schedule, where)
  assert max(sum(slots.ring_sizes[s] for s in stages)
             for stages in where.stages) == rings


def _run(name, D, P, devices, stash, optimizer, placement=None, windows=3,
         tick="auto"):
  schedule = (sp.schedules.make(name, num_stages=P, num_microbatches=1,
                                num_minibatches=2)
              if name == "pipedream" else _make(name, P, 4))
  staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                           schedule.num_stages)
  mesh = jax.make_mesh((D, devices), ("data", "stage"),
                       devices=jax.devices()[:D * devices])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer, mesh, placement=placement, stash=stash,
                           tick=tick)
  state, losses = pipe.init(staged.stage_params), []
  data = _windows(windows, 2, schedule.num_microbatches, 4 * D)
  for x, y in data:
    state, metrics = pipe.step(state, x, y)
    losses.append(float(metrics["loss"]))
  evaluated = pipe.evaluate(state, *data[0])
  state, metrics = pipe.drain(state)
  losses.append(float(metrics["loss"]))
  return pipe, losses, state, evaluated


def _dc():  # compensates with the stashed version (`stale_params`)
  return optax.chain(sp.optim.dc_asgd_ema(1.0), optax.sgd(0.3, 0.9))


@pytest.mark.parametrize("name,D,P,devices,placement,optimizer,tick", [
    ("pipedream-v", 1, 2, 2, None, _dc, "slots"),
    pytest.param("pipedream-v", 1, 4, 4, None, _dc, "slots",
                 marks=pytest.mark.slow),
    # the lanes' tick (`lanes.py`) on the pool: one lane a device
    pytest.param("pipedream-v", 1, 4, 4, None, _dc, "lanes",
                 marks=pytest.mark.slow),
    # folded onto one device: 4 lanes over 8 slots
    pytest.param("pipedream-v", 1, 4, 1, None, _dc, "lanes",
                 marks=pytest.mark.slow),
    # folded, replicas: a drain whose updates the program's plan would
    # misplace (`pool.replan`)
    pytest.param("pipedream", 2, 8, 4, "v", lambda: optax.adam(1e-2),
                 "slots", marks=pytest.mark.slow),
    pytest.param("pipedream-interleaved", 1, 4, 4, None,
                 lambda: sp.optim.SpecTrain(optax.sgd(0.3, 0.9),
                                            staleness="minibatch"),
                 "slots", marks=pytest.mark.slow),
    # synchronous, a split backward, replicas: a pool of one version a slot
    pytest.param("zb-v", 2, 2, 2, None, lambda: optax.adam(1e-2), "slots",
                 marks=pytest.mark.slow)])
def test_a_pooled_stash_trains_what_a_ring_a_slot_trains(
    name, D, P, devices, placement, optimizer, tick):
  pooled, losses, state, evaluated = _run(name, D, P, devices, "pooled",
                                          optimizer(), placement, tick=tick)
  assert (pooled.lanes is not None) == (tick == "lanes")
  slots, want_losses, want_state, want_evaluated = _run(
      name, D, P, devices, "slots", optimizer(), placement, tick="slots")
  np.testing.assert_array_equal(losses, want_losses)
  np.testing.assert_array_equal(pooled.updates_applied(state),
                                slots.updates_applied(want_state))
  for replica in range(D):
    for a, b in zip(jax.tree.leaves(pooled.params(state, replica)),
                    jax.tree.leaves(slots.params(want_state, replica)),
                    strict=True):
      np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(evaluated), jax.tree.leaves(want_evaluated),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  rows = jax.tree.leaves(state.ring[0].params)[0].shape[2]
  assert rows == pooled.program.pool_size <= sum(
      leaf.shape[2] for leaf in jax.tree.leaves(
          [r.params for r in want_state.ring]))


def _pipe(name="pipedream-v", P=2, devices=2, axes=(1, 2), **kwargs):
  schedule = _make(name, P, 4)
  staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                           schedule.num_stages)
  names = ("data", "stage", "fsdp")[:len(axes)]
  mesh = jax.make_mesh(axes, names,
                       devices=jax.devices()[:int(np.prod(axes))])
  return executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           kwargs.pop("optimizer", optax.sgd(0.1)), mesh,
                           **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(stash="ring"), "stash='ring' is invalid; valid: slots, pooled"),
    (dict(name="1f1b", axes=(1, 4), stash="pooled"),
     "a device holds one stage"),
    (dict(name="interleaved-1f1b", stash="pooled", optimizer_scope="model"),
     'optimizer_scope="model"'),
    (dict(stash="pooled", axes=(1, 2, 2)), "sharded over 'fsdp'")])
def test_what_a_pool_does_not_run_is_refused_in_one_line(kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
    _pipe(**kwargs)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("tick", ["slots", "lanes"])
def test_the_compiled_step_writes_the_pool_in_place(tick):
  """No copy of the pool in the compiled window (XLA copies an array that a
  conditional writes while another reads it unordered: `pool.claim`)."""
  pipe = _pipe(stash="pooled", tick=tick)
  schedule = pipe.schedule
  staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                           schedule.num_stages)
  x, y = _windows(1, 2, schedule.num_microbatches, 4)[0]
  text = pipe.compile(pipe.init(staged.stage_params), x, y).as_text()
  rows, length = jax.tree.leaves(pipe.init(staged.stage_params).ring[0]
                                 .params)[0].shape[2:]
  assert f"f32[{rows},{length}]" in text
  assert f"f32[{rows},{length}]{{1,0}} copy(" not in text


def test_resharding_a_pooled_stash_is_refused_in_one_line():
  source, target = _pipe(), _pipe(stash="pooled")
  schedule = source.schedule
  staged = sp.models.split(sp.models.mlp(8, 16, schedule.num_stages, 4),
                           schedule.num_stages)
  with pytest.raises(ValueError, match='valid: stash="slots" on both'):
    target.reshard(source.init(staged.stage_params), source)
