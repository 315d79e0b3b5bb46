"""Checkpoint and resume: stopped runs end bit for bit where straight runs do.

The reference is the same config run without interruption; a run stopped by
SIGTERM (delivered in-process, at whatever window it lands) and resumed from
its workdir must end with exactly its parameters. Schedules with in-flight
work across windows (pipedream: stashes and activations; hetpipe + WSP:
pending wave updates) are the ones a partial checkpoint would break.
"""

import json
import os
import pathlib
import signal
import sys
import threading
import time

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import default  # pylint: disable=g-import-not-at-top
from configs import hetpipe_wsp  # pylint: disable=g-import-not-at-top
from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top

NUM_WINDOWS = 40


@pytest.fixture(autouse=True, scope="module")
def compilation_cache(tmp_path_factory):
  """Runs of one config compile the same program: compile it once."""
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir",
                    str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def tiny(config_module=default, **overrides):
  config = config_module.get_config()
  config.model_kwargs.hidden = 16
  config.model_kwargs.num_hidden_layers = 1
  config.num_stages = 2
  config.num_microbatches, config.microbatch_size = 2, 4
  config.minibatches_per_window = 2
  config.num_steps = NUM_WINDOWS * 2
  config.log_every, config.eval_every = 1, 0
  config.checkpoint_every, config.plots = 10, False
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def params_of(workdir):
  with np.load(os.path.join(workdir, "params.npz")) as f:
    return dict(f)


def sigterm_after_first_window(workdir):
  """Sends this process SIGTERM once the run has logged its first window."""
  def watch():
    path = os.path.join(workdir, "metrics.jsonl")
    while not (os.path.exists(path) and os.path.getsize(path)):
      time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGTERM)
  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


CASES = {
    "gpipe": lambda: tiny(schedule="gpipe"),
    "pipedream": lambda: tiny(schedule="pipedream"),
    "hetpipe_wsp": lambda: tiny(hetpipe_wsp, num_microbatches=1,
                                microbatch_size=8),
}


@pytest.mark.parametrize("name", [
    "gpipe", "pipedream", pytest.param("hetpipe_wsp", marks=pytest.mark.slow)])
def test_sigterm_then_resume_equals_straight_run(tmp_path, name):
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  trainer.train_and_evaluate(CASES[name](), str(straight))

  thread = sigterm_after_first_window(str(stopped))
  first = trainer.train_and_evaluate(CASES[name](), str(stopped))
  thread.join()
  assert first["preempted"] == "SIGTERM"
  assert 0 < first["steps"] < NUM_WINDOWS * 2
  second = trainer.train_and_evaluate(CASES[name](), str(stopped))
  assert second["resumed_from_step"] == first["steps"]

  want, got = params_of(straight), params_of(stopped)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # The resumed run's log continues the stopped one without duplicates.
  records = map(json.loads, (stopped / "metrics.jsonl").open())
  steps = [r["step"] for r in records if "loss" in r]
  assert steps == list(range(2, NUM_WINDOWS * 2 + 1, 2))


@pytest.mark.slow
def test_extending_num_steps_continues_the_run(tmp_path):
  straight, extended = tmp_path / "straight", tmp_path / "extended"
  trainer.train_and_evaluate(tiny(schedule="pipedream"), str(straight))
  trainer.train_and_evaluate(tiny(schedule="pipedream", num_steps=NUM_WINDOWS),
                             str(extended))
  trainer.train_and_evaluate(tiny(schedule="pipedream"), str(extended))
  want, got = params_of(straight), params_of(extended)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_keeps_the_last_n_checkpoints(tmp_path):
  trainer.train_and_evaluate(tiny(num_steps=16, checkpoint_every=1,
                                  keep_checkpoints=3), str(tmp_path))
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
  assert steps == [6, 7, 8]


def test_unfinished_save_is_ignored_and_last_good_resumed(tmp_path):
  config = tiny(num_steps=8)
  trainer.train_and_evaluate(config, str(tmp_path))
  # A save that crashed midway leaves only orbax's temporary directory.
  (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-123").mkdir()
  config.num_steps = 12
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["resumed_from_step"] == 8


def _largest_file(directory):
  files = [p for p in directory.rglob("*") if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def test_corrupt_checkpoint_is_a_one_line_error_naming_it(tmp_path):
  config = tiny(num_steps=8)
  trainer.train_and_evaluate(config, str(tmp_path))
  step_dir = tmp_path / "checkpoints" / "4"
  victim = _largest_file(step_dir / "state")
  victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
  with pytest.raises(ValueError, match="checkpoint .*checkpoints/4 is corrupt"
                     ) as e:
    trainer.train_and_evaluate(config, str(tmp_path))
  assert "\n" not in str(e.value)


def test_checkpoint_of_another_config_is_refused(tmp_path):
  trainer.train_and_evaluate(tiny(num_steps=8), str(tmp_path))
  other = tiny(num_steps=16)
  other.model_kwargs.hidden = 32
  with pytest.raises(ValueError, match="incompatible with this config "
                     r"\(fields model_kwargs differ\)"):
    trainer.train_and_evaluate(other, str(tmp_path))


def test_nan_loss_stops_naming_the_step_and_keeps_last_good(tmp_path):
  config = tiny(num_steps=80, checkpoint_every=1, optimizer="sgd")
  config.optimizer_kwargs.learning_rate = 1e4
  with pytest.raises(ValueError, match=r"loss is (nan|inf) at step \d+ "
                     r"\(window \d+\); run stopped, last good checkpoint: "
                     ) as e:
    trainer.train_and_evaluate(config, str(tmp_path))
  bad_step = int(str(e.value).split(" at step ")[1].split()[0])
  last = int(str(e.value).rsplit("/", 1)[1])
  assert last * 2 < bad_step
  # The kept checkpoint restores, with finite weights.
  config.num_steps = last * 2
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["resumed_from_step"] == last * 2
  for value in params_of(tmp_path).values():
    assert np.all(np.isfinite(value))
