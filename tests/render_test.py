"""Renderer and CLI: events, Gantt PNG, Chrome trace, text table."""

import json

from matplotlib import image
import pytest

import stalepipe as sp
from stalepipe.schedules import __main__ as cli
from stalepipe.schedules.render import TimelineEvent


def test_schedule_events_follow_tasks():
  s = sp.schedules.make("timeprest", num_stages=3, num_microbatches=2,
                        num_minibatches=3)
  events = sp.schedules.schedule_events(s)
  assert len(events) == len(s.tasks)
  for e, t in zip(events, s.tasks):
    assert (e.row, e.start, e.duration, e.kind) == (
        f"stage {t.stage}", t.tick, s.durations[t.kind], t.kind)
    assert e.label == (str(t.minibatch) if t.kind == "B"
                       else f"{t.minibatch}.{t.microbatch}")


def test_chrome_trace(tmp_path):
  s = sp.schedules.make("hetpipe", num_stages=3, num_microbatches=1,
                        num_minibatches=4, concurrent_minibatches=2)
  events = sp.schedules.schedule_events(s) + [
      TimelineEvent("gpu 0", 1.5, 0.25, "C", "send")]
  path = tmp_path / "t.json"
  sp.schedules.chrome_trace(events, str(path))
  trace = json.loads(path.read_text())["traceEvents"]
  boxes = [e for e in trace if e["ph"] == "X"]
  names = {e["tid"]: e["args"]["name"] for e in trace
           if e["ph"] == "M" and e["name"] == "thread_name"}
  assert len(boxes) == len(events)
  for box, e in zip(boxes, events):
    assert names[box["tid"]] == e.row
    assert box["ts"] == pytest.approx(e.start * 1000)
    assert box["dur"] == pytest.approx(e.duration * 1000)
    assert box["args"]["kind"] == e.kind
  assert sorted(names.values()) == ["gpu 0", "stage 0", "stage 1", "stage 2"]


def test_gantt_png(tmp_path):
  s = sp.schedules.make("gpipe", num_stages=4, num_microbatches=4)
  path = tmp_path / "g.png"
  sp.schedules.gantt_png(sp.schedules.schedule_events(s), str(path),
                         title="gpipe")
  pixels = image.imread(str(path))
  assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 300
  assert pixels.std() > 0.05  # something was drawn


def test_bad_events_rejected(tmp_path):
  with pytest.raises(ValueError, match="kind 'X' is invalid"):
    sp.schedules.chrome_trace([TimelineEvent("r", 0, 1, "X", "")],
                              str(tmp_path / "t.json"))
  with pytest.raises(ValueError, match="time_unit 'h' is invalid"):
    sp.schedules.chrome_trace([], str(tmp_path / "t.json"), time_unit="h")


def test_cli_table_reproduces_the_tasks(tmp_path, capsys):
  png, trace = tmp_path / "s.png", tmp_path / "s.json"
  assert cli.main(["show", "timeprest", "--stages", "4", "--microbatches",
                   "2", "--png", str(png), "--trace", str(trace)]) == 0
  out = capsys.readouterr().out
  assert png.exists() and trace.exists()
  s = sp.schedules.make("timeprest", num_stages=4, num_microbatches=2,
                        num_minibatches=8)
  rows = [line.split()[2:] for line in out.splitlines()
          if line.startswith("stage") and "0:" not in line][:4]
  parsed = {(tick, stage, cell) for stage, row in enumerate(rows)
            for tick, cell in enumerate(row) if cell not in (".", "~")}
  expected = {(t.tick, t.stage, f"{t.kind}{t.minibatch}" +
               ("" if t.kind == "B" else f".{t.microbatch}"))
              for t in s.tasks}
  assert parsed == expected
  assert f"version_difference {s.version_difference}" in out


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-async"])
def test_cli_shows_split_backward(tmp_path, capsys, name):
  png, trace = tmp_path / "s.png", tmp_path / "s.json"
  assert cli.main(["show", name, "--stages", "4", "--microbatches", "8",
                   "--minibatches", "2", "--png", str(png), "--trace",
                   str(trace)]) == 0
  out = capsys.readouterr().out
  s = sp.schedules.make(name, num_stages=4, num_microbatches=8,
                        num_minibatches=2)
  lines = out.splitlines()
  rows = [line.split()[2:] for line in lines[2:6]]
  parsed = {(tick, stage, cell) for stage, row in enumerate(rows)
            for tick, cell in enumerate(row) if cell not in (".", "~")}
  assert parsed == {(t.tick, t.stage, f"{t.kind}{t.minibatch}.{t.microbatch}")
                    for t in s.tasks}
  assert f"num_ticks          {s.num_ticks}" in out
  boxes = [e for e in json.loads(trace.read_text())["traceEvents"]
           if e["ph"] == "X"]
  assert {b["cat"] for b in boxes} == {"forward", "input gradient",
                                       "weight gradient"}
  assert image.imread(str(png)).std() > 0.05


def test_device_level_schedule_rows_are_devices(tmp_path, capsys):
  """`show` of a device-level schedule: one row per device, each cell the
  kind and the chunk; the PNG and the trace have one lane per device."""
  png, trace = tmp_path / "i.png", tmp_path / "i.json"
  assert cli.main(["show", "interleaved-1f1b", "--stages", "8", "--devices",
                   "4", "--microbatches", "8", "--png", str(png), "--trace",
                   str(trace)]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("device ")]
  assert [r.split()[1] for r in rows] == ["0", "1", "2", "3"]
  assert rows[0].split()[2:6] == ["F0:0.0", "F0:0.1", "F0:0.2", "F0:0.3"]
  assert "F1:0.0" in rows[0].split()  # the device's second chunk, stage 4
  assert "device_in_flight   (11, 9, 7, 5)" in out
  assert image.imread(str(png)).std() > 0.05
  lanes = {e["args"]["name"] for e in json.loads(trace.read_text())[
      "traceEvents"] if e["name"] == "thread_name"}
  assert lanes == {f"device {d}" for d in range(4)}
  cli.main(["show", "dualpipev", "--stages", "4", "--microbatches", "4"])
  first = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("device 0"))
  assert "F0:0.3+B1:0.1" in first.split()  # an overlapped unit, one cell
