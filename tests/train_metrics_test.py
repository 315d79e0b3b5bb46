"""Metrics: JSON lines, TensorBoard events, resumed logs, plots, preemption."""

import json
import os
import re
import signal
import struct

import matplotlib.image
import numpy as np
import pytest

from stalepipe import schedules
from stalepipe.train import metrics
from stalepipe.train import preemption


def tfrecords(path):
  """The records of a TFRecord file (TensorBoard's event format)."""
  out = []
  with open(path, "rb") as f:
    while header := f.read(12):
      (length,) = struct.unpack("<Q", header[:8])
      out.append(f.read(length))
      f.read(4)
  return out


def test_writer_writes_jsonl_and_tensorboard(tmp_path):
  writer = metrics.Writer(str(tmp_path), enabled=True, resume_step=None)
  for step in (10, 20):
    writer.write(step, {"loss": 1.0 / step, "bubble": 0.25})
  writer.close()
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").open()]
  assert lines == [{"step": 10, "loss": 0.1, "bubble": 0.25},
                   {"step": 20, "loss": 0.05, "bubble": 0.25}]
  events = [p for p in (tmp_path / "tb").iterdir() if "tfevents" in p.name]
  assert len(events) == 1
  records = tfrecords(events[0])
  # The file version record, then one event per scalar.
  assert len(records) == 1 + 4
  assert all(b"loss" in r or b"bubble" in r for r in records[1:])


def test_resumed_writer_drops_records_after_the_checkpoint(tmp_path):
  writer = metrics.Writer(str(tmp_path), enabled=True, resume_step=None)
  for step in (1, 2, 3, 4):
    writer.write(step, {"loss": float(step)})
  writer.close()
  writer = metrics.Writer(str(tmp_path), enabled=True, resume_step=2)
  writer.write(3, {"loss": 30.0})
  writer.close()
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").open()]
  assert [(l["step"], l["loss"]) for l in lines] == [(1, 1.0), (2, 2.0),
                                                     (3, 30.0)]


def test_disabled_writer_writes_nothing(tmp_path):
  writer = metrics.Writer(str(tmp_path), enabled=False, resume_step=None)
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert not os.listdir(tmp_path)


def test_plots_are_pngs(tmp_path):
  records = [{"step": s, "loss": 1.0 / s} for s in range(1, 20)]
  records.append({"step": 19, "test_accuracy": 0.9})
  metrics.plot_losses(records, str(tmp_path / "loss.png"), "t")
  schedule = schedules.make("1f1b", num_stages=3, num_microbatches=4)
  metrics.plot_schedule(schedule, str(tmp_path / "schedule.png"), "t")
  for name in ("loss.png", "schedule.png"):
    image = matplotlib.image.imread(tmp_path / name)
    assert image.ndim == 3 and image.shape[0] > 100
    assert np.ptp(image) > 0  # not blank


def test_tree_bytes_counts_every_element():
  tree = {"a": np.zeros((3, 4), np.float32), "b": [np.zeros(5, np.int8)]}
  assert metrics.tree_bytes(tree) == 3 * 4 * 4 + 5


def test_preemption_catches_and_restores_handlers():
  before = signal.getsignal(signal.SIGINT)
  with preemption.Preemption() as p:
    assert not p.requested()
    os.kill(os.getpid(), signal.SIGINT)
    assert p.requested() and p.signal_name == "SIGINT"
  assert signal.getsignal(signal.SIGINT) is before


def test_resume_drops_a_last_line_cut_short_and_names_a_bad_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  whole = '{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n'
  path.write_text(whole + '{"step": 6, "lo')  # killed mid-append
  writer = metrics.Writer(str(tmp_path), True, resume_step=6)
  writer.close()
  assert path.read_text() == whole
  path.write_text('{"step": 2, "loss": 1.0}\n{"step": 4, "lo\n'
                  '{"step": 6, "loss": 0.5}\n')
  with pytest.raises(ValueError, match=(
      rf"^{re.escape(str(path))} line 2 is not a metrics record \(.*\); "
      "valid: one JSON object with a step a line; move the file aside, or "
      "--fresh$")):
    metrics.Writer(str(tmp_path), True, resume_step=6)


def test_non_finite_values_are_written_as_json_null(tmp_path):
  writer = metrics.Writer(str(tmp_path), True, resume_step=None)
  writer.write(1, {"loss": float("nan"), "grad": float("inf"), "ok": 2.0})
  writer.close()
  line = (tmp_path / "metrics.jsonl").read_text()
  assert json.loads(line) == {"step": 1, "loss": None, "grad": None,
                              "ok": 2.0}
  assert "NaN" not in line and "Infinity" not in line
