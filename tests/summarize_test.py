"""experiments/summarize.py on fake workdirs, against NumPy."""

import json
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import summarize  # pylint: disable=g-import-not-at-top,wrong-import-position

ACCURACY = {"a": [0.9, 0.95, 0.97], "b": [0.5, 0.7]}
LOSS = {"a": [0.1, 0.2, 0.4], "b": [1.0, 2.0]}


def _write(path: pathlib.Path, name: str, value) -> None:
  path.mkdir(parents=True, exist_ok=True)
  (path / name).write_text(value if isinstance(value, str)
                           else json.dumps(value))


def _fake_runs(root: pathlib.Path) -> None:
  """a-0..a-2 and b-0, b-2 finished; b-1 stopped on a NaN loss (its
  stderr says so); c-0 did not finish; a's runs have a hook's
  figures.json."""
  for row in ACCURACY:
    seeds = (0, 1, 2) if row == "a" else (0, 2)
    for seed, acc, loss in zip(seeds, ACCURACY[row], LOSS[row]):
      _write(root / f"{row}-{seed}", "summary.json",
             {"test_accuracy": acc, "final_training_loss": loss,
              "steps": 400, "device": "cpu"})
      if row == "a":
        _write(root / f"{row}-{seed}", "figures.json", {"first_loss": seed})
  _write(root / "b-1", "metrics.jsonl", '{"step": 40, "loss": 2.3}\n')
  _write(root, "b-1.err", "launch.py: error: loss is nan at step 60; run "
         "stopped, no checkpoint was saved\n")
  _write(root / "c-0", "metrics.jsonl", '{"step": 40, "loss": 2.3}\n')
  _write(root, "c-0.err", "launch.py: error: interrupted\n")


def test_table_is_numpy_mean_and_std_over_seeds(tmp_path):
  _fake_runs(tmp_path / "exp")
  out = tmp_path / "out"
  done = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "summarize.py"),
       f"--runs={tmp_path / 'exp' / '*'}", f"--out_dir={out}",
       "--keys=test_accuracy,final_training_loss,first_loss"],
      capture_output=True, text=True, check=True)
  rows = json.loads((out / "exp.json").read_text())["rows"]
  assert list(rows) == ["a", "b", "c"]
  for row in ACCURACY:
    for key, values in (("test_accuracy", ACCURACY[row]),
                        ("final_training_loss", LOSS[row])):
      np.testing.assert_allclose(rows[row]["mean"][key], np.mean(values))
      np.testing.assert_allclose(rows[row]["std"][key], np.std(values))
  np.testing.assert_allclose(rows["a"]["mean"]["first_loss"], 1.0)
  assert rows["b"]["mean"]["first_loss"] is None
  assert (rows["b"]["seeds"], rows["b"]["diverged"]) == ([0, 2], [1])
  assert (rows["c"]["seeds"], rows["c"]["unfinished"]) == ([], [0])
  assert "| a | 3 | 0.9400 ± 0.0294 | 0.2333 ± 0.1247 | 1.0000 ± 0.8165 | 0 |" \
      in done.stdout
  assert "| b | 2 | 0.6000 ± 0.1000 | 1.5000 ± 0.5000 | - | 1 |" in done.stdout
  assert "| c | 0 | - | - | - | 0 (+1 unfinished) |" in done.stdout


def test_row_and_seed():
  assert summarize.row_and_seed("runs/x/lr0.15-wp1-2/") == ("lr0.15-wp1", 2)
  assert summarize.row_and_seed("runs/x/default") == ("default", None)


def test_curve_puts_the_rolling_mean_loss_against_a_logged_key(tmp_path):
  losses, seconds = [2.0, 1.0, 0.5, 0.25], [3.0, 5.0, 8.0, 9.0]
  for panel in ("homogeneous", "hete-B"):
    lines = []
    for k, (loss, s) in enumerate(zip(losses, seconds)):
      lines += [{"step": 8 * (k + 1), "loss": loss},
                {"step": 8 * (k + 1), "simulated_seconds": s}]
    lines.append({"step": 32, "test_loss": 0.3})
    _write(tmp_path / "exp" / f"{panel}-bsp-0", "metrics.jsonl",
           "".join(json.dumps(r) + "\n" for r in lines))
    _write(tmp_path / "exp" / f"{panel}-bsp-0", "summary.json",
           {"test_accuracy": 0.9})
  x, loss = summarize.curve(str(tmp_path / "exp" / "hete-B-bsp-0"),
                            "simulated_seconds", 2)
  np.testing.assert_array_equal(x, seconds)
  np.testing.assert_allclose(loss, [2.0, 1.5, 0.75, 0.375])
  out = tmp_path / "out"
  subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "summarize.py"),
       f"--runs={tmp_path / 'exp' / '*'}", f"--out_dir={out}",
       "--keys=test_accuracy", "--curve=simulated_seconds", "--smooth=2"],
      capture_output=True, text=True, check=True)
  assert (out / "exp.png").stat().st_size > 0
