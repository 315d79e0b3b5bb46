"""At one stage, the depth study's rules in `SAME_AS_CONTROL_AT_ONE_STAGE`
(experiments/staleness_depth.py) train bit for bit like the control: the
table takes the control's S = 1 runs as theirs.

Bit for bit: the final weights (params.npz) and every logged loss. A rule
whose run is equal only to float rounding is not in the list: `dc_asgd_ema`'s
correction is zero at one stage, yet its compiled step differs, and on an
AMD EPYC its weights differ from the control's by up to 2.6e-8 after 16
steps."""

import ast
import json
import pathlib

import numpy as np
import pytest

from configs.experiments import staleness_depth
from stalepipe.train import trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A small operating point: 16 steps, the evaluation at step 8 mid-run.
ARG = "stages=1,d_model=8,windows=2,seq_len=16,steps=8,eval_every=8,eval_windows=4,lr=1e-2"


def _constant(name: str):
  """A module-level constant of experiments/staleness_depth.py, read without
  importing it (its absl flags share names with other experiments')."""
  tree = ast.parse((ROOT / "experiments" / "staleness_depth.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and node.targets[0].id == name:
      return ast.literal_eval(node.value)
  raise KeyError(name)


def _run(method: str, workdir: pathlib.Path):
  """The run's (step, loss) and (step, test_loss) rows and its final
  weights, {name: array}."""
  trainer.train_and_evaluate(
      staleness_depth.get_config(f"method={method},{ARG}"), str(workdir))
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines() if line]
  losses = {k: np.array([(r["step"], r[k]) for r in records if k in r])
            for k in ("loss", "test_loss")}
  with np.load(workdir / "params.npz") as weights:
    return losses, dict(weights)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
  return _run(_constant("CONTROL"), tmp_path_factory.mktemp("control"))


@pytest.mark.slow
@pytest.mark.parametrize("method", _constant("SAME_AS_CONTROL_AT_ONE_STAGE"))
def test_rule_at_one_stage_trains_bit_for_bit_like_the_control(
    method, control, tmp_path):
  (losses, weights), (want_losses, want_weights) = _run(
      method, tmp_path / method), control
  assert sorted(weights) == sorted(want_weights) and weights
  for name, value in want_weights.items():
    np.testing.assert_array_equal(weights[name], value, err_msg=name)
  # The evaluations at steps 8 and 16 and the loss of the window ending at 16.
  assert losses["test_loss"].shape == (2, 2) and losses["loss"].shape == (1, 2)
  for k, value in want_losses.items():
    np.testing.assert_array_equal(losses[k], value, err_msg=k)
