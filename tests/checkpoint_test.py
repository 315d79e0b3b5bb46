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
import shutil
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import default  # pylint: disable=g-import-not-at-top
from configs import hetpipe_wsp  # pylint: disable=g-import-not-at-top
from configs import pipedream_v  # pylint: disable=g-import-not-at-top
from stalepipe.train import checkpoint  # pylint: disable=g-import-not-at-top
from stalepipe.train import hooks  # pylint: disable=g-import-not-at-top
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
  config.checkpoint_every, config.plots = 20, False
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
    # each stage sharded over 2 devices: rings, stashes and optimizer state
    # saved as the members' parts, on a (2, 2, 2) mesh
    "pipedream_fsdp": lambda: tiny(schedule="pipedream", fsdp=2),
}


@pytest.mark.slow  # subprocesses, about 10 s each
@pytest.mark.parametrize("name", ["gpipe", "pipedream", "hetpipe_wsp",
                                  "pipedream_fsdp"])
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


def _evaluations(workdir):
  """(step, test loss, test accuracy) of each evaluation a run recorded."""
  records = map(json.loads, (workdir / "metrics.jsonl").open())
  return [(r["step"], r["test_loss"], r["test_accuracy"]) for r in records
          if "test_loss" in r]


@pytest.mark.parametrize("how", ["preempted", "extended"])
def test_a_resumed_run_records_each_evaluation_of_the_straight_run(tmp_path,
                                                                   how):
  """Stopped where an evaluation is due (by SIGTERM, or at its old
  `num_steps`, whose evaluation is of the drained weights) and resumed, a
  run records the straight run's evaluations, the one of the undrained
  state at the step it resumed from included."""
  def config(num_steps=24):
    return tiny(schedule="pipedream", num_steps=num_steps, eval_every=2)

  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  trainer.train_and_evaluate(config(), str(straight))
  if how == "extended":
    trainer.train_and_evaluate(config(num_steps=12), str(resumed))
  else:
    thread = sigterm_after_first_window(str(resumed))
    assert trainer.train_and_evaluate(config(),
                                      str(resumed))["preempted"] == "SIGTERM"
    thread.join()
  second = trainer.train_and_evaluate(config(), str(resumed))
  assert second["resumed_from_step"] in range(2, 24, 2)
  assert _evaluations(resumed) == _evaluations(straight)
  assert len(_evaluations(straight)) == 12  # one a window, the last drained


def _halves_equal_straight(tmp_path, first, then):
  """A run of config `then`, and one of `first` for half its windows
  resumed under `then`, end with the same parameters bit for bit."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  trainer.train_and_evaluate(then, str(straight))
  trainer.train_and_evaluate(first, str(resumed))
  trainer.train_and_evaluate(then, str(resumed))
  want, got = params_of(straight), params_of(resumed)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.slow
def test_extending_num_steps_continues_the_run(tmp_path):
  _halves_equal_straight(
      tmp_path, tiny(schedule="pipedream", num_steps=NUM_WINDOWS),
      tiny(schedule="pipedream"))


@pytest.mark.slow
def test_a_run_resumes_under_the_other_tick_bit_for_bit(tmp_path):
  """The lanes' tick holds the same state as the slots' (`lanes.py`), so a
  run stopped under one resumes under the other (`tick` may change)."""
  def config(**overrides):  # two chunks on each of 2 devices
    c = tiny(pipedream_v, num_stages=4, num_microbatches=1,
             microbatch_size=8, stash="slots", **overrides)
    c.model_kwargs.num_hidden_layers = 3  # a block a chunk
    return c

  _halves_equal_straight(tmp_path, config(tick="lanes", num_steps=NUM_WINDOWS),
                         config(tick="slots"))


@pytest.mark.slow
def test_a_pooled_stash_resumes_bit_for_bit_and_refuses_the_other(tmp_path):
  """A run on a pooled stash (`pool.py`) resumes from its checkpoint as a
  run straight through; resumed with one ring a slot, it is refused in one
  line (the state holds the versions another way), and nothing is lost."""
  def config(**overrides):  # two chunks on each of 2 devices
    c = tiny(pipedream_v, num_stages=4, num_microbatches=1,
             microbatch_size=8, **overrides)
    c.model_kwargs.num_hidden_layers = 3  # a block a chunk
    return c

  assert config().stash == "pooled"
  _halves_equal_straight(tmp_path, config(num_steps=NUM_WINDOWS), config())
  with pytest.raises(ValueError, match="stash"):
    trainer.train_and_evaluate(config(stash="slots", num_steps=4 * NUM_WINDOWS),
                               str(tmp_path / "resumed"))
  assert _steps(tmp_path / "resumed")[-1] == 2 * NUM_WINDOWS


def _steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                if p.name.isdigit())


def test_keeps_the_last_n_checkpoints(tmp_path):
  trainer.train_and_evaluate(tiny(num_steps=16, checkpoint_every=1,
                                  keep_checkpoints=3), str(tmp_path))
  assert _steps(tmp_path) == [12, 14, 16]  # named by step
  # Old steps are retired through deleted/, which is emptied after saves.
  assert not list((tmp_path / "checkpoints" / "deleted").glob("*"))


def test_emptying_deleted_keeps_the_directory_orbax_renames_into(tmp_path):
  # orbax's finaliser makes deleted/ and then renames the retired step into
  # it from another thread; removing deleted/ in between failed that save.
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1)
  (tmp_path / "deleted" / "3" / "state").mkdir(parents=True)
  (tmp_path / "deleted" / "3" / "state" / "x").write_bytes(b"0")
  ckpt._empty_deleted()  # pylint: disable=protected-access
  assert (tmp_path / "deleted").is_dir()
  assert not list((tmp_path / "deleted").iterdir())
  (tmp_path / "4").mkdir()
  (tmp_path / "4").rename(tmp_path / "deleted" / "4")  # what orbax does next
  ckpt.close()


def test_state_of_another_layout_is_refused_in_one_line_and_kept(tmp_path):
  # A checkpoint of another version of stalepipe (here: one state leaf
  # named otherwise) is neither restored nor set aside as corrupt.
  state = {"ring": np.arange(4.0, dtype=np.float32),
           "step": np.zeros((), np.int32)}
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1)
  ckpt.save(3, state, {"step": 3}, {"seed": 0})
  ckpt.wait()
  abstract = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
      {"ring": (state["ring"],), "step": state["step"]})
  with pytest.raises(ValueError, match=r"checkpoint .*/3 holds a state laid "
                     r"out otherwise .*\(leaves ring, ring_0 differ\); "
                     r"valid: the version that wrote it, or a new "
                     r"--workdir") as e:
    ckpt.restore(abstract, {"seed": 0})
  assert "\n" not in str(e.value)
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [
      "3"]
  assert not (tmp_path / "corrupt").exists()
  ckpt.close()


def test_unfinished_save_is_ignored_and_last_good_resumed(tmp_path):
  config = tiny(num_steps=8)
  trainer.train_and_evaluate(config, str(tmp_path))
  # A save that crashed midway leaves only orbax's temporary directory, and
  # a deletion that crashed midway a gutted step under deleted/.
  (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-123").mkdir()
  (tmp_path / "checkpoints" / "deleted" / "2" / "state").mkdir(parents=True)
  config.num_steps = 12
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["resumed_from_step"] == 8


def _chunk_copies(state_dir):
  """Where the bytes of the state's largest stored chunk lie on disk.

  Corrupting "the middle of the largest file" is not enough: an OCDBT data
  file also holds b-tree nodes of earlier commits that no read touches, and
  which file holds what varies with save timing. The largest chunk's bytes
  are read on restore; every copy of them (an earlier commit may hold one)
  is returned as (path, start, length).
  """
  kvstore = ts.KvStore.open(
      {"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
  chunk = max((kvstore.read(key).result().value
               for key in kvstore.list().result()), key=len)
  copies = []
  for path in sorted(state_dir.rglob("*")):
    data = path.read_bytes() if path.is_file() else b""
    start = data.find(chunk)
    while start >= 0:
      copies.append((path, start, len(chunk)))
      start = data.find(chunk, start + 1)
  assert copies, f"no copy of a {len(chunk)}-byte chunk under {state_dir}"
  return copies


def _tree_bytes(directory):
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def _corrupt_truncated(step_dir):
  """Cuts each file holding the largest chunk in the middle of that chunk."""
  for path, start, length in _chunk_copies(step_dir / "state"):
    path.write_bytes(path.read_bytes()[:start + length // 2])


def _corrupt_flipped(step_dir):
  """Flips 8 bytes in the middle of the largest chunk, keeping sizes: its
  zstd frame still decodes, to other values, which the state checksums catch."""
  for path, start, length in _chunk_copies(step_dir / "state"):
    data = bytearray(path.read_bytes())
    for i in range(start + length // 2, start + length // 2 + 8):
      data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_emptied(step_dir):
  shutil.rmtree(step_dir)
  step_dir.mkdir()


@pytest.mark.parametrize("corrupt,why", [
    (_corrupt_truncated, "corrupt"),
    (_corrupt_flipped, "checksum mismatch"),
    pytest.param(_corrupt_emptied, "corrupt", marks=pytest.mark.slow),
])
def test_bad_latest_checkpoint_is_skipped_and_the_run_ends_bit_for_bit(
    tmp_path, corrupt, why):
  straight, faulty = tmp_path / "straight", tmp_path / "faulty"
  trainer.train_and_evaluate(tiny(num_steps=24), str(straight))
  config = tiny(num_steps=16, checkpoint_every=8, keep_checkpoints=2)
  trainer.train_and_evaluate(config, str(faulty))
  assert _steps(faulty) == [8, 16]
  corrupt(faulty / "checkpoints" / "16")
  config.num_steps = 24
  summary = trainer.train_and_evaluate(config, str(faulty))
  assert summary["resumed_from_step"] == 8
  assert summary["skipped_checkpoints"] == [
      summary["skipped_checkpoints"][0]]
  assert summary["skipped_checkpoints"][0].startswith(
      f"{faulty}/checkpoints/16 ({why}")
  # Kept for inspection, out of the way of later saves.
  assert (faulty / "checkpoints" / "corrupt" / "16").is_dir()
  want, got = params_of(straight), params_of(faulty)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.slow
def test_no_checkpoint_that_verifies_is_one_line_naming_each(tmp_path):
  config = tiny(num_steps=8, checkpoint_every=4, keep_checkpoints=2)
  trainer.train_and_evaluate(config, str(tmp_path))
  for step in (4, 8):
    _corrupt_flipped(tmp_path / "checkpoints" / str(step))
  metrics_before = (tmp_path / "metrics.jsonl").read_bytes()
  config.num_steps = 12
  with pytest.raises(ValueError, match=r"no checkpoint in .*checkpoints "
                     r"verifies: .*checkpoints/8 \(checksum mismatch.*"
                     r"checkpoints/4 \(checksum mismatch") as e:
    trainer.train_and_evaluate(config, str(tmp_path))
  assert "\n" not in str(e.value)
  assert (tmp_path / "metrics.jsonl").read_bytes() == metrics_before


def test_rerunning_a_finished_workdir_changes_nothing(tmp_path):
  config = tiny(num_steps=8)
  first = trainer.train_and_evaluate(config, str(tmp_path))
  before = _tree_bytes(tmp_path)
  again = trainer.train_and_evaluate(config, str(tmp_path))
  assert again["already_finished"] and again["steps"] == first["steps"]
  assert _tree_bytes(tmp_path) == before


def _strict_json(text):
  def refuse(name):
    raise ValueError(f"{name} is not JSON")
  return json.loads(text, parse_constant=refuse)


def test_stop_between_last_checkpoint_and_summary_finishes_it(tmp_path):
  config = tiny(num_steps=8)
  first = trainer.train_and_evaluate(config, str(tmp_path))
  # Killed after the final checkpoint, before summary.json and params.npz.
  (tmp_path / "summary.json").unlink()
  (tmp_path / "params.npz").unlink()
  second = trainer.train_and_evaluate(config, str(tmp_path))
  summary = _strict_json((tmp_path / "summary.json").read_text())
  assert summary["final_training_loss"] == first["final_training_loss"]
  assert summary["steps_per_s"] > 0
  assert second["resumed_from_step"] == 8
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  finals = [r for r in records if "loss" not in r]
  assert len(finals) == 1, finals
  assert (tmp_path / "params.npz").stat().st_size > 0


def test_num_steps_below_the_checkpoint_is_refused_untouched(tmp_path):
  trainer.train_and_evaluate(tiny(num_steps=8), str(tmp_path))
  before = _tree_bytes(tmp_path)
  with pytest.raises(ValueError, match=r"num_steps=4 is below step 8 of "
                     r"checkpoint .*checkpoints/8; valid: num_steps >= 8"):
    trainer.train_and_evaluate(tiny(num_steps=4), str(tmp_path))
  assert _tree_bytes(tmp_path) == before


def test_signals_after_training_let_the_run_finish(tmp_path, monkeypatch):
  """SIGTERM twice during the final evaluation: the run still completes."""
  evaluate = hooks.evaluate

  def signalled_evaluate(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(*args)

  monkeypatch.setattr(hooks, "evaluate", signalled_evaluate)
  summary = trainer.train_and_evaluate(tiny(num_steps=8), str(tmp_path))
  assert summary["signal_after_training"] == "SIGTERM"
  assert (tmp_path / "params.npz").stat().st_size > 0
  assert _strict_json((tmp_path / "summary.json").read_text())["steps"] == 8


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
  with pytest.raises(ValueError, match=r"loss is (nan|inf) at step \d+; run "
                     r"stopped, last good checkpoint: ") as e:
    trainer.train_and_evaluate(config, str(tmp_path))
  bad_step = int(str(e.value).split(" at step ")[1].split(";")[0])
  last = int(str(e.value).rsplit("/", 1)[1])
  assert last < bad_step  # checkpoints are named by step
  # The kept checkpoint restores, with finite weights.
  config.num_steps = last
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["resumed_from_step"] == last
  for value in params_of(tmp_path).values():
    assert np.all(np.isfinite(value))


def test_a_checkpoint_records_its_precision_and_refuses_another(tmp_path):
  """A float32 run resumed under JAX_ENABLE_X64=1 would go on in float64."""
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1)
  ckpt.save(2, {"w": jnp.ones(3)}, {"step": 2}, {"seed": 0})
  ckpt.wait()
  jax.config.update("jax_enable_x64", True)
  try:
    with pytest.raises(ValueError, match=r"fields jax_enable_x64 differ"):
      ckpt.restore({"w": jax.ShapeDtypeStruct((3,), jnp.float32)},
                   {"seed": 0})
  finally:
    jax.config.update("jax_enable_x64", False)
  state, _ = ckpt.restore({"w": jax.ShapeDtypeStruct((3,), jnp.float32)},
                          {"seed": 0})
  assert state["w"].tolist() == [1.0, 1.0, 1.0]
  ckpt.close()
