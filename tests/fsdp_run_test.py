"""A run with `fsdp` from its config: the mesh, the checks, the memory limit.

`config.fsdp` shards each stage over that many devices (a third mesh axis
'fsdp', `stalepipe/pipeline/fsdp.py`); the run trains what fsdp=1 trains,
and a state that would not fit `device_memory_mib` unsharded is refused,
naming fsdp, and runs sharded.
"""

import jax
import numpy as np
import pytest

from stalepipe.train import build
from stalepipe.train import checkpoint
from stalepipe.train import trainer
from tests.run_path_test import tiny


def _pipedream(**overrides):
  """PipeDream on 4 stages folded onto 2 devices: a deep stash."""
  config = tiny(schedule="pipedream", num_stages=4, stage_devices=2,
                **overrides)
  config.model_kwargs.num_hidden_layers = 3
  return config


@pytest.mark.slow  # 10-30 s on two cores
def test_fsdp_builds_a_three_axis_mesh_and_trains_what_fsdp_1_does(tmp_path):
  parts = build.parts(_pipedream(fsdp=4))
  assert dict(parts.mesh.shape) == {"data": 1, "stage": 2, "fsdp": 4}
  sharded = trainer.train_and_evaluate(_pipedream(fsdp=4),
                                       str(tmp_path / "f4"))
  whole = trainer.train_and_evaluate(_pipedream(), str(tmp_path / "f1"))
  assert sharded["steps"] == whole["steps"] == 8
  for name in ("f4", "f1"):
    assert (tmp_path / name / "params.npz").exists()
  with np.load(tmp_path / "f4" / "params.npz") as a, np.load(
      tmp_path / "f1" / "params.npz") as b:
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("overrides,match", [
    ({"fsdp": 3}, "fsdp=3 is invalid; valid: a divisor of microbatch_size=4"),
    ({"fsdp": 8}, "does not fit the 8 CPU devices"),
])
def test_an_fsdp_that_does_not_factor_is_one_line(overrides, match):
  with pytest.raises(ValueError, match=match):
    build.parts(_pipedream(**overrides, microbatch_size=4
                           if overrides["fsdp"] == 3 else 8))


@pytest.mark.slow  # 10-30 s on two cores
def test_a_state_over_the_memory_limit_is_refused_and_runs_sharded(tmp_path):
  whole = build.parts(_pipedream())
  need = {F: build.parts(_pipedream(fsdp=F)).pipeline.state_bytes(
      whole.staged.stage_params) for F in (1, 4)}
  # A member holds a quarter of every part (and the 4-byte counts whole).
  for part in ("weights", "optimizer", "accumulator"):
    assert need[4][part] * 4 <= need[1][part] + 64, need
  state = whole.pipeline.init(whole.staged.stage_params)
  held = sum(v.addressable_shards[0].data.nbytes
             for v in jax.tree.leaves([r.params for r in state.ring]))
  assert held == need[1]["weights"]  # the arithmetic is what is placed
  limit = (need[1]["total"] + need[4]["total"]) / 2 / 2**20
  with pytest.raises(ValueError, match=r"over device_memory_mib=.*valid: a "
                     r"larger fsdp"):
    build.parts(_pipedream(device_memory_mib=limit))
  summary = trainer.train_and_evaluate(
      _pipedream(device_memory_mib=limit, fsdp=4), str(tmp_path))
  assert summary["steps"] == 8


@pytest.mark.slow  # 10-30 s on two cores
def test_a_run_resumes_onto_another_fsdp_size(tmp_path):
  """Half the run with each stage on one device, the rest sharded over 4
  (the checkpoint resharded, `Pipeline.reshard`), ends where a straight
  run does, to the reduce-scatter's rounding."""
  straight, moved = tmp_path / "straight", tmp_path / "moved"
  trainer.train_and_evaluate(_pipedream(checkpoint_every=4), str(straight))
  trainer.train_and_evaluate(_pipedream(num_steps=4, checkpoint_every=4),
                             str(moved))
  second = trainer.train_and_evaluate(_pipedream(fsdp=4, checkpoint_every=4),
                                      str(moved))
  assert second["resumed_from_step"] == 4
  with np.load(straight / "params.npz") as a, np.load(
      moved / "params.npz") as b:
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=2e-6)


def test_a_checkpoint_older_than_the_field_counts_as_fsdp_1():
  old = {"schedule": "pipedream"}
  assert checkpoint.changed_fields(old, {"schedule": "pipedream",
                                         "fsdp": 1}) == []
  assert checkpoint.changed_fields(old, {"schedule": "pipedream",
                                         "fsdp": 2}) == ["fsdp"]
