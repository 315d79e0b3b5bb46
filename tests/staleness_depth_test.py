"""experiments/staleness_depth.py on fake workdirs, against a hand computation.

Run as a subprocess: its flags share names with experiments/summarize.py's,
which tests/summarize_test.py imports.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Validation loss at steps 10, 20, 30, 40 of each run.
CURVES = {
    "m-S1-0": [4.0, 3.0, 2.0, 1.5],
    "m-S1-1": [4.0, 2.5, 2.0, 1.0],
    "m-S4-0": [4.0, 3.5, 3.0, 2.5],
    "m-S4-1": [4.0, 3.8, 3.0, 2.0],
    "m-S8-0": [4.0, 3.5, 3.0, 2.6],
    "m-S8-1": [4.0, 3.5, 2.5, 2.0],
    "n-S1-0": [5.0, 4.0, 3.0, 2.0],
    "n-S4-0": [5.0, 4.0, 3.0, 2.5],
    "n-S4-1": [5.0, 2.5, 2.0, 2.0],  # n has no S=1 run of seed 1
    "m-S32-2": [4.0, 3.0, 2.0, 2.0],  # nor m of seed 2
    "m-S16-0": [4.0],  # unfinished: no summary.json, no error
}


def _fake_runs(root: pathlib.Path) -> None:
  for name, losses in CURVES.items():
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 10 * (i + 1), "loss": 9.0}) + "\n" +
        json.dumps({"step": 10 * (i + 1), "test_loss": loss}) + "\n"
        for i, loss in enumerate(losses)))
    if name != "m-S16-0":
      (root / name / "summary.json").write_text("{}")
  (root / "m-S2-0").mkdir()
  (root / "m-S2-0" / "metrics.jsonl").write_text(
      '{"step": 10, "test_loss": 4.0}\n')
  (root / "m-S2-0.err").write_text("launch.py: error: loss is nan at step "
                                   "12; run stopped\n")


def _write_runs(root: pathlib.Path, curves: dict, num_steps=None) -> None:
  """Finished runs with validation losses at steps 10, 20, ... (and a
  config.json naming `num_steps`, the drained evaluation's step)."""
  for name, losses in curves.items():
    run = root / name
    run.mkdir(parents=True)
    if num_steps is not None:
      (run / "config.json").write_text(json.dumps({"num_steps": num_steps}))
    (run / "summary.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 10 * (i + 1), "test_loss": v}) + "\n"
        for i, v in enumerate(losses)))


def _table(root: pathlib.Path, *flags: str) -> dict:
  out = root / "out"
  subprocess.run([sys.executable, str(ROOT / "experiments" /
                                      "staleness_depth.py"),
                  f"--runs={root / 'exp' / '*'}", f"--out_dir={out}", *flags],
                 capture_output=True, text=True, check=True)
  assert (out / "staleness_depth.md").exists()
  assert (out / "staleness_depth.png").exists()
  return json.loads((out / "staleness_depth.json").read_text())


def test_steps_to_target_and_slowdown_by_hand(tmp_path):
  _fake_runs(tmp_path / "exp")
  result = _table(tmp_path, "--target_loss=2.5", "--loss_at=20,35,50")
  m = result["rows"]["m"]
  # S=1: seed 0 crosses 2.5 between 20 (3.0) and 30 (2.0): 20 + 10 * 0.5;
  # seed 1 is at 2.5 at step 20: 10 + 10 * 1.5 / 1.5.
  assert m["1"]["steps"] == pytest.approx((25.0 + 20.0) / 2)
  # S=4: 30 + 10 * 0.5 / 0.5 = 40 and 30 + 10 * 0.5 / 1.0 = 35.
  assert m["4"]["steps"] == pytest.approx((40.0 + 35.0) / 2)
  assert m["4"]["slowdown"] == pytest.approx(37.5 / 22.5)
  assert m["4"]["per_seed"] == {"0": 40.0, "1": 35.0}
  # S=8: seed 0 never reaches 2.5 in its 40 steps: at least 40 / 22.5.
  assert m["8"]["steps"] is None and m["8"]["at_least"] == 40.0
  assert m["8"]["slowdown_at_least"] == pytest.approx(40.0 / 22.5)
  # S=2 diverged at its first evaluation; S=16 is unfinished (no cell).
  assert m["2"]["at_least"] == 10.0 and "16" not in m
  assert result["rows"]["n"]["1"]["slowdown"] == pytest.approx(1.0)
  # A slowdown is over the seeds both cells have: n at S=4 averages seeds 0
  # (40) and 1 (20), but is divided as seed 0 alone, by n's S=1 (35).
  n = result["rows"]["n"]
  assert n["4"]["steps"] == pytest.approx(30.0)
  assert n["4"]["slowdown"] == pytest.approx(40.0 / 35.0)
  assert n["4"]["slowdown_seeds"] == [0]
  # m at S=32 ran seed 2 only, which S=1 lacks: steps, but no slowdown.
  assert m["32"]["steps"] == pytest.approx(25.0)
  assert m["32"]["slowdown"] is None and m["32"]["slowdown_seeds"] == []
  # --loss_at: m at S=1, seeds 0 and 1 at step 20 (3.0, 2.5); at 35 their
  # step-30 evaluations (2.0, 2.0); at 50 beyond their 40 steps. n's one
  # seed. The unfinished m at S=16 and the diverged m at S=2 have no row.
  text = (tmp_path / "out" / "staleness_depth.md").read_text()
  # The cells: m at S=4, mean 37.5 of 35 and 40; n at S=4, one seed of two
  # shared with S=1; m at S=8, a seed short of the target.
  assert ("| m | 1/2 | 22 [20-25] (1.00x) | >10 (>0.40x) | 38 [35-40] "
          "(1.67x) | >40 (>1.78x) | 25 |") in text
  assert "| n | 1/2 | 35 (1.00x) | - | 30 [20-40] (1.14x) | - | - |" in text
  assert "| m | 1 | 2 | 2.750 | 2.000 | - |" in text
  assert "| n | 1 | 1 | 4.000 | 3.000 | - |" in text
  assert "| m | 16 |" not in text and "| m | 2 |" not in text


def test_default_target_is_the_worst_s1_method_at_the_fraction(tmp_path):
  _fake_runs(tmp_path / "exp")
  # At step 0.5 * 40 = 20: m's seeds 3.0 and 2.5 (mean 2.75), n's 4.0.
  assert _table(tmp_path, "--target_fraction=0.5")["target_loss"] == 4.0
  # At step 12 the last evaluation is step 10's: m's 4.0, n's 5.0.
  assert _table(tmp_path, "--target_fraction=0.3")["target_loss"] == 5.0


def test_rates_best_at_s1_and_per_depth_and_the_drained_point_is_left_out(
    tmp_path):
  curves = {  # validation loss at steps 10, 20, 30 (30: the drained one)
      "r@1e-3-S1-0": [3.0, 2.0, 9.0], "r@3e-3-S1-0": [2.0, 1.0, 9.0],
      "r@1e-3-S8-0": [3.0, 2.0, 0.0], "r@3e-3-S8-0": [3.0, 3.0, 0.0],
      "b@1e-3-S1-0": [2.0, 1.0, 9.0], "b@1e-3-S8-0": [3.0, 3.0, 0.0]}
  _write_runs(tmp_path / "exp", curves, num_steps=30)
  result = _table(tmp_path, "--target_loss=2.0")
  rows = result["rows"]
  # The drained evaluation at num_steps (step 30) is not a point: S=8 at
  # 3e-3 never reaches 2.0 though its drained loss is 0.
  assert rows["r@3e-3-S8-0".rsplit("-S", 1)[0]]["8"]["steps"] is None
  assert rows["r@1e-3"]["1"]["steps"] == 20.0
  assert rows["r@3e-3"]["1"]["steps"] == pytest.approx(10.0)
  best = result["best_rates"]["r"]
  assert best["at_s1"] == "3e-3" and best["per_depth"] == {"1": "3e-3",
                                                           "8": "1e-3"}
  # The figure draws each depth at its best rate there, its slowdown over
  # the best S = 1 cell (r: 20 / 10); b misses the target at S = 8 after
  # 20 steps (the drained point is not one): at least 20 / 10.
  assert result["figure"]["r"] == [
      {"stages": 1, "rate": "3e-3", "method": "r@3e-3", "slowdown": 1.0,
       "at_least": None},
      {"stages": 8, "rate": "1e-3", "method": "r@1e-3", "slowdown": 2.0,
       "at_least": None}]
  assert [(c["stages"], c["slowdown"], c["at_least"])
          for c in result["figure"]["b"]] == [(1, 1.0, None), (8, None, 2.0)]
  text = (tmp_path / "out" / "staleness_depth.md").read_text()
  assert "| r (3e-3) | 1e-3, 3e-3 | 10 (1.00x) | >20 (>2.00x) |" in text
  assert "| r | 1e-3, 3e-3 | 10 (1.00x) @3e-3 | 20 (2.00x) @1e-3 |" in text


def test_a_depth_with_one_rate_of_the_grid_is_flagged_not_called_best(
    tmp_path):
  curves = {  # validation loss at steps 10, 20, 30; target 2.0
      "r@1e-3-S1-0": [3.0, 2.0, 1.0], "r@3e-3-S1-0": [2.0, 1.0, 1.0],
      "r@3e-3-S8-0": [3.0, 3.0, 2.0],  # S = 8: 3e-3 alone
      "r@1e-3-S32-0": [3.0, 3.0, 3.0], "r@3e-3-S32-0": [3.0, 2.5, 2.5],
      "q@1e-3-S1-0": [3.0, 2.0, 1.0],  # S = 1: 1e-3 alone
      "q@1e-3-S8-0": [3.0, 3.0, 2.0], "q@3e-3-S8-0": [3.0, 2.0, 2.0]}
  _write_runs(tmp_path / "exp", curves)
  result = _table(tmp_path, "--target_loss=2.0")
  r, q = result["best_rates"]["r"], result["best_rates"]["q"]
  assert r["run_at"] == {"1": ["1e-3", "3e-3"], "8": ["3e-3"],
                         "32": ["1e-3", "3e-3"]}
  assert q["run_at"] == {"1": ["1e-3"], "8": ["1e-3", "3e-3"]}
  text = (tmp_path / "out" / "staleness_depth.md").read_text()
  # r: S = 1 best of two (10 < 20); S = 8 its one rate there; S = 32 neither
  # reaches 2.0, 3e-3 ends lower (2.5 < 3.0).
  assert ("| r | 1e-3, 3e-3 | 10 (1.00x) @3e-3 | 30 (3.00x) @3e-3 (only rate "
          "run) | >30 @3e-3 |") in text
  assert "| q (1e-3, only rate run) | 1e-3, 3e-3 | 20 (1.00x) |" in text
  assert "| r (3e-3) |" in text


def test_s1_cell_of_a_rule_equal_to_the_control_is_the_controls_run(
    tmp_path):
  curves = {  # validation loss at steps 10, 20, 30
      "1f1b@3e-3-S1-0": [3.0, 2.0, 1.0], "1f1b@3e-3-S1-1": [3.0, 2.5, 1.5],
      "pipedream@3e-3-S8-0": [3.0, 3.0, 2.0],
      "pipedream@3e-3-S8-1": [3.0, 2.5, 2.0],
      "nesterov@3e-3-S8-0": [3.0, 2.0, 1.0],  # not the control at S = 1
      "spectrain@1e-3-S8-0": [3.0, 2.0, 1.0],  # no control at its rate
      "weight_pred@3e-3-S1-0": [3.0, 3.0, 2.0],  # its own S = 1 run stays
      "weight_pred@3e-3-S8-0": [3.0, 3.0, 2.0]}
  _write_runs(tmp_path / "exp", curves)
  result = _table(tmp_path, "--target_loss=2.0", "--loss_at=20")
  rows = result["rows"]
  assert result["s1_from_control"] == ["pipedream@3e-3"]
  # The control's seeds reach 2.0 at 20 and 25 (mean 22.5); pipedream's at
  # S = 8 at 30 and 30: 30 / 22.5.
  assert rows["pipedream@3e-3"]["1"]["steps"] == 22.5
  assert rows["pipedream@3e-3"]["8"]["slowdown"] == pytest.approx(30 / 22.5)
  assert "1" not in rows["nesterov@3e-3"] and "1" not in rows[
      "spectrain@1e-3"]
  assert rows["weight_pred@3e-3"]["1"]["steps"] == 30.0
  text = (tmp_path / "out" / "staleness_depth.md").read_text()
  assert "S=1 of pipedream@3e-3: the 1f1b runs at the same rate" in text
  # The loss table lists each run once: no pipedream row at S = 1.
  assert "| pipedream@3e-3 | 1 |" not in text
  assert "| 1f1b@3e-3 | 1 | 2 | 2.250 |" in text


def test_rates_are_ranked_on_the_seeds_they_share(tmp_path):
  curves = {  # validation loss at steps 10, 20, 30, 40
      # At S = 8, 1e-3 reaches 2.0 at 20, 30, 40 (seeds 0-2; mean 30) and
      # 3e-3 at 25 on seed 0 alone: on seed 0, 1e-3 (20) is ahead, though
      # its mean over three seeds is behind 3e-3's one seed.
      "r@1e-3-S8-0": [3.0, 2.0, 1.5, 1.0], "r@1e-3-S8-1": [3.0, 2.5, 2.0, 1.5],
      "r@1e-3-S8-2": [3.0, 2.5, 2.5, 2.0], "r@3e-3-S8-0": [3.0, 2.5, 1.5, 1.5],
      # At S = 1, 1e-3 (seed 1 only) and 3e-3 (seed 0 only) share no seed:
      # each is ranked on its own, 1e-3's 20 ahead of 3e-3's 30.
      "r@1e-3-S1-1": [3.0, 2.0, 1.0, 1.0], "r@3e-3-S1-0": [3.0, 2.5, 2.0, 1.0],
      # On the seeds they share, equal steps: the lower last loss (1e-2's).
      "q@3e-3-S8-0": [3.0, 2.0, 2.0, 2.0], "q@1e-2-S8-0": [3.0, 2.0, 1.5, 1.0],
      "q@1e-2-S8-1": [3.0, 3.0, 3.0, 3.0]}
  _write_runs(tmp_path / "exp", curves)
  result = _table(tmp_path, "--target_loss=2.0")
  r, q = result["best_rates"]["r"], result["best_rates"]["q"]
  assert r["per_depth"] == {"1": "1e-3", "8": "1e-3"}
  assert r["compared_seeds"] == {"1": {"1e-3/3e-3": []},
                                 "8": {"1e-3/3e-3": [0]}}
  # q at S = 8: 1e-2's seed 1 never reaches 2.0, but the rates share seed 0
  # only, on which both reach it at 20; 1e-2 ends lower there (1.0 < 2.0).
  assert q["per_depth"] == {"8": "1e-2"}
  assert q["compared_seeds"] == {"8": {"3e-3/1e-2": [0]}}
  text = (tmp_path / "out" / "staleness_depth.md").read_text()
  # The cell is the chosen rate's mean over all its seeds; the note says
  # which seeds each comparison used.
  assert "| r | 1e-3, 3e-3 | 20 (1.00x) @1e-3 | 30 [20-40] (1.50x) @1e-3 |" \
      in text
  assert "r at S=8: 1e-3/3e-3 on seed 0" in text
  assert "r at S=1: 1e-3/3e-3 on their own seeds (none shared)" in text
  assert "q at S=8: 3e-3/1e-2 on seed 0" in text


def test_two_rates_with_three_seeds_each_are_ranked_on_all_three(tmp_path):
  curves = {  # validation loss at steps 10, 20, 30, 40; target 2.0
      # Seed 0: 3e-3 (reaches 2.0 at 20) is ahead of 1e-3 (30) and 1e-2
      # (40). Over the seeds 1e-3 and 3e-3 both ran (0-2), 1e-3 reaches it at
      # 30, 20, 20 (mean 23.3) and 3e-3 at 20, 40, never: 1e-3 is ahead. A
      # ranking on the one seed all three rates share would pick 3e-3.
      "r@1e-3-S8-0": [3.0, 2.5, 2.0, 1.5], "r@1e-3-S8-1": [3.0, 2.0, 1.5, 1.0],
      "r@1e-3-S8-2": [3.0, 2.0, 1.5, 1.0],
      "r@3e-3-S8-0": [3.0, 2.0, 1.5, 1.0], "r@3e-3-S8-1": [3.0, 3.0, 2.5, 2.0],
      "r@3e-3-S8-2": [3.0, 3.0, 3.0, 3.0],
      "r@1e-2-S8-0": [3.0, 3.0, 2.5, 2.0]}
  _write_runs(tmp_path / "exp", curves)
  result = _table(tmp_path, "--target_loss=2.0")
  r = result["best_rates"]["r"]
  assert r["compared_seeds"]["8"] == {"1e-3/3e-3": [0, 1, 2],
                                      "1e-3/1e-2": [0], "3e-3/1e-2": [0]}
  # 1e-3 beats 3e-3 (on seeds 0-2) and 1e-2 (seed 0: 30 < 40): two wins.
  assert r["per_depth"] == {"8": "1e-3"}
  # Alone, the pair on seed 0 would go the other way.
  del curves["r@1e-3-S8-1"], curves["r@1e-3-S8-2"]
  _write_runs(tmp_path / "one_shared" / "exp", curves)
  result = _table(tmp_path / "one_shared", "--target_loss=2.0")
  assert result["best_rates"]["r"]["per_depth"] == {"8": "3e-3"}


def test_kept_records_rebuild_the_same_tables_and_are_never_overwritten(
    tmp_path):
  _fake_runs(tmp_path / "exp")
  (tmp_path / "exp" / "m-S1-0" / "config.json").write_text('{"lr": 1}')
  kept = tmp_path / "kept"
  flags = ("--target_loss=2.5", "--loss_at=20,35,50")
  from_runs = _table(tmp_path, *flags, f"--keep_to={kept}")
  # Every finished or stopped run is kept, the unfinished one is not; the
  # stopped run keeps its error line, so it still reads as stopped.
  assert sorted(p.name for p in kept.iterdir()) == sorted(
      [n for n in CURVES if n != "m-S16-0"] + ["m-S2-0", "m-S2-0.err"])
  assert (kept / "m-S1-0" / "config.json").read_text() == '{"lr": 1}'
  assert (kept / "m-S2-0.err").read_text().startswith(
      "launch.py: error: loss is nan")
  out = tmp_path / "out2"
  subprocess.run([sys.executable, str(ROOT / "experiments" /
                                      "staleness_depth.py"),
                  f"--runs={kept / '*'}", f"--out_dir={out}", *flags],
                 capture_output=True, text=True, check=True)
  from_kept = json.loads((out / "staleness_depth.json").read_text())
  assert from_kept["rows"] == from_runs["rows"]
  assert ((out / "staleness_depth.md").read_text() ==
          (tmp_path / "out" / "staleness_depth.md").read_text())
  # Keeping again passes over the records already there (the refused run
  # is the last); another run of a kept name is refused in one line, and
  # the kept record stays.
  (tmp_path / "exp" / "n-S4-1" / "metrics.jsonl").write_text(
      '{"step": 10, "test_loss": 1.0}\n')
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" /
                                             "staleness_depth.py"),
                         f"--runs={tmp_path / 'exp' / '*'}",
                         f"--keep_to={kept}", *flags],
                        capture_output=True, text=True)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"staleness_depth.py: error: --keep_to: {kept / 'n-S4-1'} holds "
      "another run's record")
  assert '"test_loss": 2.5' in (kept / "n-S4-1" / "metrics.jsonl").read_text()
