"""The trainer's evaluation through the mesh and its drain at the end.

Evaluation: `hooks.evaluate` runs `Pipeline.evaluate` over the test set in
windows of the step's shape and must equal the unpipelined model's figures
on the same weights, the last window's padding left out. Drain: a run that
reaches `num_steps` writes the weights of every minibatch it trained on (the
oracle's after the same windows and its drain), keeps the state before the
drain in its checkpoint, and continues from it bit for bit.
"""

import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stalepipe import models  # pylint: disable=g-import-not-at-top
from stalepipe.pipeline import reference  # pylint: disable=g-import-not-at-top
from stalepipe.train import build  # pylint: disable=g-import-not-at-top
from stalepipe.train import hooks  # pylint: disable=g-import-not-at-top
from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
from tests import run_path_test  # pylint: disable=g-import-not-at-top


def tiny(**overrides):
  """run_path_test's tiny config over 4 stages."""
  config = run_path_test.tiny(num_stages=4)
  config.model_kwargs.num_hidden_layers = 3
  for key, value in overrides.items():
    config[key] = value
  return config


CHARS = {"dataset": "chars", "dataset_kwargs": {"seq_len": 8},
         "model": "transformer", "loss": "lm_cross_entropy",
         "model_kwargs": {"d_model": 8, "num_heads": 2, "num_layers": 2}}


def _params(workdir) -> dict[str, np.ndarray]:
  with np.load(workdir / "params.npz") as f:
    return dict(f)


def _flat(stage_params) -> dict[str, np.ndarray]:
  """Stage parameters keyed as params.npz keys them."""
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_flatten_with_path(tuple(stage_params))[0]}


def _unpipelined(parts, stage_params) -> tuple[float, float]:
  """The test set's mean loss and per-label accuracy, the whole model at
  once on one device."""
  x, y = parts.test
  logits = models.unpipelined(parts.staged)(stage_params, jnp.asarray(x))
  accuracy = jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(y))
  return float(parts.loss_fn(logits, jnp.asarray(y))), float(accuracy)


@pytest.mark.parametrize("overrides", [
    {"num_replicas": 2, "microbatch_size": 4},  # 359 rows, windows of 32
    pytest.param(CHARS, marks=pytest.mark.slow),
], ids=["digits", "chars"])
def test_evaluation_through_the_mesh_equals_the_unpipelined_model(overrides):
  parts = build.parts(tiny(schedule="pipedream", **overrides))
  pipe = parts.pipeline
  state = pipe.init(parts.staged.stage_params)
  for window in range(2):  # trained weights, minibatches in flight
    state, _ = pipe.step(state, *parts.batch(window))
  num_examples, per_window = len(parts.test[0]), np.prod(parts.window_shape)
  assert num_examples % per_window  # the last window is padded
  got = hooks.evaluate(pipe, state, *parts.test, parts.loss_fn,
                       parts.window_shape)
  want = _unpipelined(parts, pipe.params(state))
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_eval_rows_pad_the_last_window_with_weight_zero():
  rows, weights = hooks.eval_rows(7, (1, 2, 2, 1))
  assert rows.shape == weights.shape == (2, 1, 2, 2)
  assert rows.ravel().tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
  assert weights.ravel().tolist() == [1] * 7 + [0]


def _run_and_drain(parts, num_windows: int, oracle: bool):
  """The weights after `num_windows` windows and the drain, straight from
  the executor or the oracle, the drain's metrics, and the most updates a
  stage missed before it (the minibatches it finished)."""
  if oracle:
    pipe = reference.Pipeline(parts.staged.stage_fns, parts.loss_fn,
                              parts.schedule, parts.pipeline.optimizer)
    def updates(state):
      return np.array([len(v) for v in state.versions.values()])
  else:
    pipe = parts.pipeline

    def updates(state):
      return pipe.updates_applied(state)
  state = pipe.init(parts.staged.stage_params)
  for window in range(num_windows):
    state, _ = pipe.step(state, *parts.batch(window))
  undrained, before = _flat(pipe.params(state)), updates(state)
  state, metrics = pipe.drain(state)
  drained = _flat(pipe.params(state))
  assert any(not np.array_equal(undrained[k], drained[k]) for k in drained)
  return drained, metrics, int((updates(state) - before).max())


@pytest.mark.parametrize("oracle", [
    False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["executor", "oracle"])
def test_pipedream_writes_the_drained_weights(tmp_path, oracle):
  config = tiny(schedule="pipedream")
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  parts = build.parts(config)
  want, metrics, missed = _run_and_drain(
      parts, config.num_steps // config.minibatches_per_window, oracle)
  got = _params(tmp_path)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=0 if not oracle
                               else 1e-5, atol=0 if not oracle else 1e-6,
                               err_msg=key)
  assert summary["drained_minibatches"] == missed > 0
  assert summary["drained_num_losses"] == metrics["num_losses"] > 0
  assert summary["drained_loss"] == pytest.approx(float(metrics["loss"]),
                                                  rel=1e-5)
  # The final figures are the drained weights', through the mesh.
  stage_params = parts.staged.stage_params
  drained = jax.tree.unflatten(jax.tree.structure(stage_params),
                               [got[k] for k in _flat(stage_params)])
  np.testing.assert_allclose(
      (summary["test_loss"], summary["test_accuracy"]),
      _unpipelined(parts, drained), rtol=2e-6)
  # What computed it: records from two hosts may differ in the last digits.
  assert (summary["host"]["jax"], summary["host"]["jaxlib"]) == (
      jax.__version__, jax.lib.__version__)
  assert summary["host"]["machine"] == platform.machine()
  assert summary["host"]["cpu"]
  # One evaluation at the end: the drained weights'.
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "test_loss" in r] == [8]


def test_a_flush_schedules_drain_changes_nothing(tmp_path):
  config = tiny(schedule="1f1b")
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["drained_minibatches"] == 0
  assert summary["drained_num_losses"] == 0
  assert summary["drained_loss"] is None
  parts = build.parts(config)
  pipe = parts.pipeline
  state = pipe.init(parts.staged.stage_params)
  for window in range(config.num_steps // config.minibatches_per_window):
    state, _ = pipe.step(state, *parts.batch(window))
  want, got = _flat(pipe.params(state)), _params(tmp_path)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_finished_pipedream_run_extended_equals_the_longer_run(tmp_path):
  """Its checkpoint is the state before the drain: a larger num_steps
  continues it bit for bit, then drains once at the new end."""
  straight, extended = tmp_path / "straight", tmp_path / "extended"
  longer = trainer.train_and_evaluate(tiny(schedule="pipedream", num_steps=8),
                                      str(straight))
  first = trainer.train_and_evaluate(tiny(schedule="pipedream", num_steps=4),
                                     str(extended))
  assert first["drained_minibatches"] > 0
  second = trainer.train_and_evaluate(tiny(schedule="pipedream", num_steps=8),
                                      str(extended))
  assert second["resumed_from_step"] == 4
  want, got = _params(straight), _params(extended)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert second["test_loss"] == longer["test_loss"]


def test_a_drain_that_is_not_finite_stops_and_keeps_the_checkpoint(tmp_path):
  parts = build.parts(tiny(schedule="pipedream"))
  parts.pipeline.drain = lambda state: (state, {"loss": float("nan"),
                                                "num_losses": 1})
  with pytest.raises(ValueError, match=r"loss nan or weights not finite in "
                     r"the drain after step 8; run stopped, last good "
                     r"checkpoint: .*checkpoints/8$"):
    trainer.train(parts, str(tmp_path))
  assert not (tmp_path / "summary.json").exists()
  assert not (tmp_path / "params.npz").exists()
  assert (tmp_path / "checkpoints" / "8").is_dir()
