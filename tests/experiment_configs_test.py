"""Every row of every experiment config (configs/experiments/) builds."""

import pathlib
import re
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stalepipe.train import build  # pylint: disable=g-import-not-at-top

ROWS = {
    "sapipe_table2.py": [f"rule={r}" for r in
                         ("sync", "pipesgd", "dc", "wp1", "wp2", "wp3")],
    "zero_bubble_convergence.py": [
        f"row={r}" for r in ("zb_h1", "zb_async", "zb_async_dc", "pipedream")],
    "staleness_convergence.py": [
        f"rule={r},lr=0.15" for r in ("sync", "pipesgd", "dc_diagonal", "dc",
                                      "wp1", "wp2", "wp3", "nesterov")],
    "small_models.py": [f"variant={v}" for v in (
        "mlp_synthetic", "vgg_digits", "resnet_digits", "transformer_chars")],
    "staleness_depth.py": [f"method={m},stages={s}" for m in (
        "1f1b", "pipedream", "zb_async", "pipemare", "nesterov", "spectrain",
        "sapipe_wp", "dc", "basis_rotation", "gap_aware", "muon",
        "dc_asgd_ema", "weight_pred") for s in (1, 16)] + [
            f"method={m},stages={s}" for m in ("pipedream_v",
                                               "pipedream_interleaved")
            for s in (2, 16)],
    "sync_wallclock.py": [f"policy={p},stragglers={s}" for p in (
        "bsp", "wsp0", "wsp4", "wsp32", "sdpipe", "ad_psgd") for s in (
            "homogeneous", "hete-A", "hete-B")],
}


def test_every_experiment_config_is_listed():
  assert sorted(p.name for p in (ROOT / "configs" / "experiments").glob(
      "*.py")) == sorted(ROWS)


@pytest.mark.parametrize("filename", sorted(ROWS))
def test_docstring_holds_the_commands_of_every_row(filename):
  module = runpy.run_path(str(ROOT / "configs" / "experiments" / filename))
  doc = module["__doc__"]
  assert f"--config=configs/experiments/{filename}:" in doc
  assert "experiments/summarize.py --runs=" in doc
  text = (ROOT / "configs" / "experiments" / filename).read_text()
  assert re.search(r"from configs import \w+", text)
  code = text.split('"""', 2)[2]  # after the docstring that holds the commands
  assert len(code.splitlines()) < 40


@pytest.mark.slow
@pytest.mark.parametrize("filename,arg", [
    (f, a) for f, args in sorted(ROWS.items()) for a in args])
def test_row_builds(filename, arg):
  get_config = runpy.run_path(
      str(ROOT / "configs" / "experiments" / filename))["get_config"]
  config = get_config(f"{arg},seed=1")
  assert config.seed == 1
  build.parts(config)


@pytest.mark.parametrize("arg,message", [
    ("method=nope", "method='nope' is invalid; valid: 1f1b, pipedream, "),
    ("method=zb_async,stages=32", "windows=16 is invalid for zb_async at "
     "stages=32; valid: a multiple of 32, its micro-batches"),
    ("stages=abc", "config argument stages='abc' is invalid; valid: a value of type int"),
    ("lr=fast", "config argument lr='fast' is invalid; valid: a value of type float"),
])
def test_depth_study_refuses_a_bad_row_in_one_line(arg, message):
  get_config = runpy.run_path(str(
      ROOT / "configs" / "experiments" / "staleness_depth.py"))["get_config"]
  with pytest.raises(ValueError, match=re.escape(message)):
    get_config(arg)
