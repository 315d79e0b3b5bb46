"""At one stage, the depth study's rules in `SAME_AS_CONTROL_AT_ONE_STAGE`
(experiments/staleness_depth.py) train bit for bit like the control: the
table takes the control's S = 1 runs as theirs."""

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


def _losses(method: str, workdir: pathlib.Path) -> np.ndarray:
  trainer.train_and_evaluate(
      staleness_depth.get_config(f"method={method},{ARG}"), str(workdir))
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines() if line]
  return np.array([(r["step"], r[k]) for r in records
                   for k in ("loss", "test_loss") if k in r])


@pytest.fixture(scope="module")
def control(tmp_path_factory):
  return _losses(_constant("CONTROL"), tmp_path_factory.mktemp("control"))


@pytest.mark.slow
@pytest.mark.parametrize("method", _constant("SAME_AS_CONTROL_AT_ONE_STAGE"))
def test_rule_at_one_stage_trains_bit_for_bit_like_the_control(
    method, control, tmp_path):
  losses = _losses(method, tmp_path / method)
  assert losses.shape == control.shape == (3, 2)  # loss 16, test 8 and 16
  np.testing.assert_array_equal(losses, control)
