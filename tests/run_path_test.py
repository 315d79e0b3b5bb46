"""The path from a config to a run: parts by name, the loop and its hooks,
intervals in steps, old checkpoints, one run per workdir."""

import json
import os
import pathlib
import signal
import sys
import time

import ml_collections
import numpy as np
import pytest

from tests import launching

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import default  # pylint: disable=g-import-not-at-top
from experiments import hooks as example_hooks  # pylint: disable=g-import-not-at-top
from stalepipe import data  # pylint: disable=g-import-not-at-top
from stalepipe import models  # pylint: disable=g-import-not-at-top
from stalepipe import optim  # pylint: disable=g-import-not-at-top
from stalepipe import schedules  # pylint: disable=g-import-not-at-top
from stalepipe import sync  # pylint: disable=g-import-not-at-top
from stalepipe.models import losses  # pylint: disable=g-import-not-at-top
from stalepipe.train import build  # pylint: disable=g-import-not-at-top
from stalepipe.train import hooks  # pylint: disable=g-import-not-at-top
from stalepipe.train import loop  # pylint: disable=g-import-not-at-top
from stalepipe.train import optimizers  # pylint: disable=g-import-not-at-top
from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
from tests import configs_test  # pylint: disable=g-import-not-at-top


def tiny(**overrides) -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model_kwargs.hidden, config.model_kwargs.num_hidden_layers = 16, 1
  config.num_stages, config.num_replicas = 2, 1
  config.num_microbatches, config.microbatch_size = 2, 4
  config.minibatches_per_window, config.num_steps = 2, 8
  config.log_every, config.eval_every, config.checkpoint_every = 2, 0, 0
  config.plots = False
  for key, value in overrides.items():
    config[key] = value
  return config


# Every name each registry lists, with the config fields it needs.
IMAGES = {"input_shape": (8, 8, 1)}
CHARS = {"dataset": "chars", "dataset_kwargs": {"seq_len": 8},
         "model": "transformer", "loss": "lm_cross_entropy",
         "model_kwargs": {"d_model": 8, "num_heads": 2, "num_layers": 2}}
WAVES = {"schedule": "hetpipe",
         "schedule_kwargs": {"concurrent_minibatches": 2}}
PLANES = {
    # Device-level schedules need num_chunks and their placement:
    # tests/device_schedules_executor_test.py runs their configs.
    "schedule": (tuple(n for n in schedules.names()
                       if n not in schedules.DEVICE_LEVEL), lambda n: {
        "schedule": n, **(WAVES if n == "hetpipe" else {})}),
    "sync": (sync.names(), lambda n: {
        "sync": n, "num_replicas": 2, **(WAVES if n == "wsp" else {}),
        "sync_kwargs": {"wsp": {"clock_distance": 1},
                        "local_sgd": {"period": 2},
                        "simulated": {"policy": "sdpipe"}}.get(n, {})}),
    "model": (models.names(), lambda n: {
        "mlp": {}, "vgg": {**IMAGES, "model": "vgg", "model_kwargs": {
            "stages": ((4,), (4,)), "dense": (8,)}},
        "resnet": {**IMAGES, "model": "resnet", "model_kwargs": {
            "stem_width": 4, "widths": (4,), "depths": (1,)}},
        "transformer": CHARS}[n]),
    "dataset": (data.names(), lambda n: {
        "digits": {}, "chars": CHARS,
        "stdlib": {**CHARS, "dataset": "stdlib", "dataset_kwargs": {
            "seq_len": 8, "max_test_windows": 64, "cache_dir": "CACHE"}},
        "synthetic": {"dataset": "synthetic", "dataset_kwargs": {
            "num_train": 256, "num_test": 64, "in_features": 8,
            "num_classes": 4}},
        "cifar10": {"dataset": "cifar10", "dataset_kwargs": {
            "data_dir": "CIFAR"}}}[n]),
    "loss": (losses.names(), lambda n: {
        "cross_entropy": {}, "lm_cross_entropy": CHARS}[n]),
    "transform": (optim.names(), lambda n: {"transforms": ((n, {
        "stale_gradients": {"delay": 1},
        "delay_compensation": {"lam": 0.1},
        "scale_by_staleness": {"staleness": 1.0},
        "scale_by_async_nesterov": {"delay": 1, "num_stages": 2},
        "wave_accumulation": {"wave_size": 2},
        "basis_rotation_adam": {"learning_rate": 0.01},
        "clip_by_group_norm": {"max_norm": 1.0},
    }.get(n, {})),)}),
    "optimizer wrapper": (optim.WRAPPERS.names(), lambda n: {
        "optimizer_wrapper": (n, {
            "PipeMare": {"warmup_steps": 2, "decay": 0.5},
            "WeightPrediction": {"option": 3},
            # The paper's pipeline-wide staleness needs pipedream without
            # stashing and one micro-batch; the default config is gpipe.
            "SpecTrain": {"staleness": "minibatch"},
            "stale_optimizer": {"delay": 1}}.get(n, {})),
        "optimizer_scope": "stage"}),
    "optimizer": (optimizers.OPTIMIZERS.names(), lambda n: {"optimizer": n}),
    "learning-rate schedule": (optimizers.SCHEDULES.names(), lambda n: {
        "lr_schedule": (n, SCHEDULE_KWARGS[n])}),
}
SCHEDULE_KWARGS = {
    "constant_schedule": {"value": 0.1},
    "cosine_decay_schedule": {"init_value": 0.1, "decay_steps": 4},
    "cosine_onecycle_schedule": {"transition_steps": 4, "peak_value": 0.1},
    "exponential_decay": {"init_value": 0.1, "transition_steps": 2,
                          "decay_rate": 0.5},
    "linear_onecycle_schedule": {"transition_steps": 4, "peak_value": 0.1},
    "linear_schedule": {"init_value": 0.1, "end_value": 0.0,
                        "transition_steps": 4},
    "piecewise_constant_schedule": {"init_value": 0.1,
                                    "boundaries_and_scales": {"2": 0.5}},
    "piecewise_interpolate_schedule": {"interpolate_type": "linear",
                                       "init_value": 0.1,
                                       "boundaries_and_scales": {"2": 0.5}},
    "polynomial_schedule": {"init_value": 0.1, "end_value": 0.0, "power": 2,
                            "transition_steps": 4},
    "sgdr_schedule": {"cosine_kwargs": ({"init_value": 0.1, "peak_value": 0.2,
                                         "warmup_steps": 1, "decay_steps": 4},)},
    "warmup_constant_schedule": {"init_value": 0.0, "peak_value": 0.1,
                                 "warmup_steps": 2},
    "warmup_cosine_decay_schedule": {"init_value": 0.0, "peak_value": 0.1,
                                     "warmup_steps": 2, "decay_steps": 8},
    "warmup_exponential_decay_schedule": {
        "init_value": 0.0, "peak_value": 0.1, "warmup_steps": 2,
        "transition_steps": 2, "decay_rate": 0.5},
}
# One name per plane in the quick suite, every other one in the slow suite.
CASES = [pytest.param(plane, name, id=f"{plane}:{name}",
                      marks=() if i == 0 else pytest.mark.slow)
         for plane, (names, _) in PLANES.items()
         for i, name in enumerate(names)]


def _config_for(plane, name, tmp_path):
  config = tiny()
  for key, value in PLANES[plane][1](name).items():
    config[key] = (ml_collections.ConfigDict(value) if isinstance(value, dict)
                   else value)
  if config.dataset == "cifar10":
    config.dataset_kwargs.data_dir = configs_test.write_cifar10(
        tmp_path, images_per_batch=16)
  if config.dataset == "stdlib":
    config.dataset_kwargs.cache_dir = str(tmp_path)
  return config


@pytest.mark.parametrize("plane,name", CASES)
def test_every_registered_name_builds_through_the_config_path(
    tmp_path, plane, name):
  """What the check accepts builds; what it refuses is one ValueError line."""
  config = _config_for(plane, name, tmp_path)
  try:
    parts = build.parts(config)
  except ValueError as e:
    # Only optax optimizers that need more than a learning rate may refuse,
    # and only in one line naming what is missing.
    assert plane == "optimizer" and "is missing" in str(e), str(e)
    assert "\n" not in str(e)
    return
  assert set(SCHEDULE_KWARGS) == set(optimizers.SCHEDULES.names())
  assert len(parts.staged.stage_fns) == config.num_stages
  if plane in ("schedule", "sync"):
    # `simulated` builds the policy it replays (`sync_kwargs.policy`).
    built_as = (name, name.upper(), config.sync_kwargs.get("policy"))
    assert getattr(parts.schedule if plane == "schedule" else
                   parts.pipeline.sync, "name", name) in built_as


def test_a_transform_that_is_no_transform_is_refused_by_the_check():
  config = tiny(transforms=(("delay_aware_momentum",
                             {"b1": .9, "delay": 1, "num_stages": 4}),))
  with pytest.raises(ValueError, match=r"transforms\[0\] name="
                     r"'delay_aware_momentum' is invalid; valid: "
                     "stale_gradients, "):
    build.parts(config)


_launch = launching.launch


def test_delay_aware_momentum_is_refused_before_the_first_line(tmp_path):
  result = _launch("--config=configs/sapipe.py",
                   "--config.transforms=(('delay_aware_momentum', {'b1': 0.9,"
                   " 'delay': 1, 'num_stages': 4}),)", workdir=tmp_path / "w")
  assert result.returncode == 1 and result.stdout == "", result.stdout
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "launch.py: error: transforms[0] name='delay_aware_momentum' is "
      "invalid; valid: "), result.stderr[-2000:]
  assert not (tmp_path / "w").exists()


def test_loop_calls_hooks_where_due_and_stops_on_request():
  calls = []

  class Every:
    def __init__(self, every):
      self.every = every

    def __call__(self, run):
      calls.append((self.every, run.step))
      if run.step >= 20 and self.every == 6:
        raise loop.Stop("enough")

    def end(self, run):
      calls.append(("end", run.step))

  end, why = loop.run(lambda state, x: (state + x, {"loss": 0.0}),
                      loop.Run(0, 0, {}), lambda w: (1,), num_steps=40,
                      steps_per_window=4, hooks=[Every(10), Every(6)])
  assert why == "enough" and end.step == 20 and end.state == 5
  assert calls == [(6, 8), (10, 12), (6, 12), (10, 20), (6, 20),
                   ("end", 20), ("end", 20)]


def test_intervals_count_steps_and_checkpoints_are_named_by_step(tmp_path):
  config = tiny(num_steps=24, minibatches_per_window=4, log_every=6,
                checkpoint_every=10, keep_checkpoints=5)
  trainer.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [8, 12, 20, 24]
  assert sorted(int(p) for p in os.listdir(tmp_path / "checkpoints")
                if p.isdigit()) == [12, 20, 24]


def _params(workdir):
  with np.load(workdir / "params.npz") as f:
    return dict(f)


def test_a_workdir_with_window_named_checkpoints_resumes_bit_for_bit(
    tmp_path):
  """Checkpoints once named their window, with {"window": w} positions."""
  straight, old = tmp_path / "straight", tmp_path / "old"
  trainer.train_and_evaluate(tiny(num_steps=16), str(straight))
  trainer.train_and_evaluate(tiny(num_steps=8), str(old))
  step_dir = old / "checkpoints" / "8"
  position = step_dir / "position" / "metadata"
  record = json.loads(position.read_text())
  record.pop("step")
  record.pop("position_sha256")  # older checkpoints had none
  position.write_text(json.dumps({"window": 4, **record}))
  step_dir.rename(old / "checkpoints" / "4")
  (old / "summary.json").unlink()
  summary = trainer.train_and_evaluate(tiny(num_steps=16), str(old))
  assert summary["resumed_from_step"] == 8
  want, got = _params(straight), _params(old)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_windows_where_no_minibatch_finished_log_no_loss(tmp_path):
  """PipeDream at S=4 with one minibatch per window: the first windows end
  no minibatch; their records carry no loss (never NaN)."""
  config = tiny(schedule="pipedream", num_stages=4, minibatches_per_window=1,
                num_microbatches=1, num_steps=8, log_every=1)
  config.model_kwargs.num_hidden_layers = 3
  summary = trainer.train_and_evaluate(config, str(tmp_path))

  def refuse(name):
    raise AssertionError(f"{name} in a record")

  records = [json.loads(line, parse_constant=refuse)
             for line in open(tmp_path / "metrics.jsonl")]
  logged = [r for r in records if "num_losses" in r]
  assert [r["step"] for r in logged] == list(range(1, 9))
  assert ["loss" in r for r in logged] == [r["num_losses"] > 0
                                           for r in logged]
  assert not logged[0].get("loss") and "loss" in logged[-1]
  assert np.isfinite(summary["test_loss"])


@pytest.mark.slow  # sleeps 6 s
def test_summary_throughput_leaves_out_evaluation(tmp_path, monkeypatch):
  evaluate = hooks.evaluate

  def slow_evaluate(*args):
    time.sleep(1.0)
    return evaluate(*args)

  monkeypatch.setattr(hooks, "evaluate", slow_evaluate)
  start = time.perf_counter()
  summary = trainer.train_and_evaluate(tiny(num_steps=12, eval_every=2),
                                       str(tmp_path))
  wall = time.perf_counter() - start
  evaluations = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  evaluations = [r for r in evaluations if "test_loss" in r]
  assert [r["step"] for r in evaluations] == [2, 4, 6, 8, 10, 12]
  assert summary["test_loss"] == evaluations[-1]["test_loss"]
  assert summary["seconds"] < wall - 5.0
  assert summary["steps_per_s"] == pytest.approx(
      10 / summary["seconds"], rel=1e-6)


def test_a_users_hook_from_a_config_records_stage_norms(tmp_path):
  config = tiny(hooks=(("experiments.hooks:StageNorms", {"every": 4}),))
  trainer.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / "stage_norms.jsonl")]
  assert [r["step"] for r in records] == [4, 8]
  final = _params(tmp_path)
  for s, norm in enumerate(records[-1]["norms"]):
    leaves = [v for k, v in final.items() if k.startswith(f"[{s}]")]
    assert norm == pytest.approx(
        np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in leaves)),
        rel=1e-6)
  assert example_hooks.StageNorms.__doc__


def test_a_hook_that_cannot_be_imported_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"hooks\[0\] 'experiments.hooks:Nope' "
                     "is invalid: .*valid: 'package.module:factory'"):
    build.parts(tiny(hooks=(("experiments.hooks:Nope", {}),)))


@pytest.mark.slow  # a launcher that runs until killed: about 35 s
def test_a_second_run_on_a_workdir_is_refused_and_a_killed_one_leaves_no_lock(
    tmp_path):
  first = _launch("--config.num_steps=400000", "--config.log_every=4",
                  "--config.eval_every=0", "--config.checkpoint_every=40",
                  workdir=tmp_path, wait=False)
  try:
    metrics = tmp_path / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size):
      assert first.poll() is None, first.communicate()[1][-2000:]
      time.sleep(0.1)
    second = _launch("--config.num_steps=400000", workdir=tmp_path)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1 and len(lines) == 1, second.stderr[-2000:]
    assert lines[0].startswith(f"launch.py: error: --workdir={tmp_path} is in "
                               f"use by PID {first.pid} on host "), lines[0]
    while not any(p.isdigit() for p in os.listdir(tmp_path / "checkpoints")):
      time.sleep(0.1)
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate()
  last = max(int(p) for p in os.listdir(tmp_path / "checkpoints")
             if p.isdigit())
  resumed = _launch(f"--config.num_steps={last + 8}", "--config.eval_every=0",
                    workdir=tmp_path)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resuming from checkpoint" in resumed.stdout + resumed.stderr


@pytest.mark.parametrize("module,kwargs,message", [
    ("broken_syntax", {}, r"hooks\[0\] 'hookmods\.broken_syntax:make' is "
     r"invalid: SyntaxError: .*valid: 'package\.module:factory'"),
    ("raises_on_import", {}, r"hooks\[0\] 'hookmods\.raises_on_import:make' "
     r"is invalid: RuntimeError: no GPU here; valid: "),
    ("fine", [1, 2], r"hooks\[0\] hookmods\.fine:make kwargs \[1, 2\] are "
     r"invalid; valid: a dict of the factory's keyword arguments"),
])
def test_a_hook_module_or_kwargs_that_fail_are_one_line(
    tmp_path, monkeypatch, module, kwargs, message):
  package = tmp_path / "hookmods"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "broken_syntax.py").write_text("def make(:\n")
  (package / "raises_on_import.py").write_text(
      "raise RuntimeError('no GPU here')\n")
  (package / "fine.py").write_text("def make(parts, workdir):\n  return None\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError, match=message):
    build.parts(tiny(hooks=((f"hookmods.{module}:make", kwargs),)))


def _failing_factory(parts, workdir):
  del parts, workdir
  raise OSError("quota exceeded")


def _no_hook_factory(parts, workdir):
  del parts, workdir


@pytest.mark.slow  # two tiny runs each
@pytest.mark.parametrize("factory,message", [
    ("_failing_factory", r"hooks\[0\] _failing_factory failed: OSError: "
     "quota exceeded"),
    ("_no_hook_factory", r"hooks\[0\] _no_hook_factory returned NoneType; "
     "valid: a hook, a callable with an `every` attribute"),
])
def test_a_hook_factory_that_fails_is_refused_before_anything_is_written(
    tmp_path, factory, message):
  config = tiny(hooks=((f"tests.run_path_test:{factory}", {}),))
  with pytest.raises(ValueError, match=message):
    trainer.train_and_evaluate(config, str(tmp_path / "w"))
  written = [p.name for p in (tmp_path / "w").rglob("*") if p.is_file()]
  assert written == ["lock"]  # (and the checkpoint manager's empty folder)
  # Nothing blocks the next run: the same workdir trains without --fresh.
  config.hooks = ()
  assert trainer.train_and_evaluate(config, str(tmp_path / "w"))["steps"] == 8
