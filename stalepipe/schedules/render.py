"""Timelines of pipeline work: Gantt charts (PNG) and Chrome/Perfetto traces.

A timeline is a list of `TimelineEvent`s, one box each: a row (a stage or a
device), a start time and duration, a kind and a short label. Schedules turn
into timelines with `schedule_events`; the simulator builds its own (with
updates, communication and waits) and draws them with the same functions.

The Gantt chart reads like HetPipe's Figure 1 (seed 001 §4) and TiMePReSt's
Figure 7 (seed 003 §4): one row per stage, top to bottom, time to the right,
forward and backward boxes coloured apart, the minibatch (and micro-batch) id
written in each box.

Examples:
  >>> import stalepipe as sp
  >>> s = sp.schedules.make("gpipe", num_stages=2, num_microbatches=1)
  >>> [(e.row, e.start, e.kind, e.label) for e in schedule_events(s)]
  [('stage 0', 0, 'F', '0'), ('stage 1', 1, 'F', '0'), ('stage 1', 2, 'B', '0'), ('stage 0', 3, 'B', '0')]
"""

import collections
import json
import os
from typing import NamedTuple, Sequence

from stalepipe.schedules import kinds as kinds_lib

# Besides the task kinds (`kinds.KINDS`, each with its colour), the simulator
# draws updates red, communication orange and waits grey.
_OTHER_MARKS = {"U": ("update", "#e06666"), "C": ("communication", "#f6b26b"),
                "W": ("wait", "#d9d9d9")}
_COLOURS = {**{k.name: k.colour for k in kinds_lib.KINDS.values()},
            **{m: c for m, (_, c) in _OTHER_MARKS.items()}}
_NAMES = {**{k.name: k.description for k in kinds_lib.KINDS.values()},
          **{m: n for m, (n, _) in _OTHER_MARKS.items()}}
EVENT_KINDS = tuple(_COLOURS)
if len(EVENT_KINDS) != len(kinds_lib.KINDS) + len(_OTHER_MARKS):
  raise ImportError("a task kind's name clashes with a renderer mark "
                    f"{tuple(_OTHER_MARKS)}")
# Chrome traces count in microseconds; one time unit becomes this many.
_TRACE_SCALE = {"tick": 1000.0, "s": 1e6, "ms": 1e3, "us": 1.0}


class TimelineEvent(NamedTuple):
  """One box on a timeline."""

  row: str  # what the row shows: "stage 2", "gpu 3", ...
  start: float  # in `time_unit`s
  duration: float  # in `time_unit`s
  kind: str  # one of EVENT_KINDS
  label: str  # short text drawn in the box, e.g. the minibatch id


def _check(events: Sequence[TimelineEvent]) -> None:
  for e in events:
    if e.kind not in EVENT_KINDS:
      raise ValueError(f"event kind {e.kind!r} is invalid; valid kinds: "
                       f"{', '.join(EVENT_KINDS)}")
    if e.duration < 0:
      raise ValueError(f"event duration {e.duration!r} is invalid; it must "
                       "be >= 0")


def _rows(events: Sequence[TimelineEvent]) -> list[str]:
  """Rows in first-appearance order, with `stage k` rows sorted by k."""
  rows = list(dict.fromkeys(e.row for e in events))

  def key(row):
    head, _, tail = row.rpartition(" ")
    return (head, int(tail)) if tail.isdigit() else (row, -1)

  return sorted(rows, key=key)


def schedule_events(schedule) -> list[TimelineEvent]:
  """The tasks of a schedule as timeline events, one per task.

  The label is the minibatch id, followed by the micro-batch id as
  `p.m` when the schedule has more than one micro-batch per minibatch (for
  TiMePReSt's backward, which covers the whole minibatch, just `p`).

  A device-level schedule (one with a placement) has one row per device,
  `"device d"`, and the label starts with the task's chunk on it (its slot,
  `c:p.m`): an overlapped pair is two events that start together.

  Args:
    schedule: a `stalepipe.schedules.Schedule`.

  Returns:
    Events with rows `"stage s"` (or `"device d"`), in task order, times in
    ticks.
  """
  events = []
  for t in schedule.tasks:
    label = str(t.minibatch)
    whole = len(schedule.covered_microbatches(t)) > 1
    if schedule.num_microbatches > 1 and not whole:
      label = f"{t.minibatch}.{t.microbatch}"
    row = f"stage {t.stage}"
    if schedule.placed is not None:
      device, chunk = schedule.placed.where(t.stage)
      row, label = f"device {device}", f"{chunk}:{label}"
    events.append(TimelineEvent(row, t.tick, schedule.durations[t.kind],
                                t.kind, label))
  return events


def gantt_png(events: Sequence[TimelineEvent], path: str, *,
              title: str | None = None, time_unit: str = "tick") -> None:
  """Draws a Gantt chart of `events` into a PNG file.

  Rows top to bottom (stage 0 on top, like seed 001 Figure 1), time to the
  right, one coloured box per event with its label inside.

  Args:
    events: the timeline.
    path: the PNG file to write.
    title: optional title above the chart.
    time_unit: the unit of `start` and `duration`, shown on the time axis.
  """
  _check(events)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = _rows(events)
  index = {r: i for i, r in enumerate(rows)}
  end = max((e.start + e.duration for e in events), default=1.0)
  width = min(40.0, max(6.0, 0.45 * end + 2.0))
  fig, ax = plt.subplots(figsize=(width, 0.55 * len(rows) + 1.4))
  # Events that start together on one row (an overlapped forward and
  # backward) share its height, one above the other.
  together = collections.Counter((e.row, e.start) for e in events)
  drawn = collections.Counter()
  for e in events:
    height = 0.8 / together[(e.row, e.start)]
    y = index[e.row] - 0.4 + height * drawn[(e.row, e.start)]
    drawn[(e.row, e.start)] += 1
    ax.add_patch(patches.Rectangle((e.start, y), e.duration, height,
                                   facecolor=_COLOURS[e.kind],
                                   edgecolor="black", linewidth=0.6))
    if e.label and e.duration > 0:
      size = 8 if len(e.label) <= 2 * e.duration + 1 else 6
      ax.text(e.start + e.duration / 2, y + height / 2, e.label, ha="center",
              va="center", fontsize=size)
  ax.set_xlim(0, end)
  ax.set_ylim(len(rows) - 0.5, -0.5)
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel(f"time ({time_unit})")
  if time_unit == "tick" and end <= 80:
    ax.set_xticks(range(0, int(end) + 1, 1 if end <= 40 else 2))
  ax.grid(axis="x", linewidth=0.3, alpha=0.5)
  ax.set_axisbelow(True)
  kinds = [k for k in EVENT_KINDS if any(e.kind == k for e in events)]
  ax.legend(handles=[patches.Patch(facecolor=_COLOURS[k], edgecolor="black",
                                   label=_NAMES[k]) for k in kinds],
            loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 4
                                                else -0.18),
            ncol=len(kinds), frameon=False, fontsize=8)
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def chrome_trace(events: Sequence[TimelineEvent], path: str, *,
                 time_unit: str = "tick") -> dict:
  """Writes `events` as a Chrome trace (JSON) that Perfetto and chrome://tracing load.

  Every event is a complete event (`"ph": "X"`) on thread `tid` = its row's
  index, with times in microseconds: one tick maps to 1000 us so the trace
  viewer's ms axis reads as ticks. Rows are named through `thread_name`
  metadata events.

  Args:
    events: the timeline.
    path: the JSON file to write.
    time_unit: the unit of `start`/`duration`: "tick", "s", "ms" or "us".

  Returns:
    The trace dictionary that was written.
  """
  _check(events)
  if time_unit not in _TRACE_SCALE:
    raise ValueError(f"time_unit {time_unit!r} is invalid; valid: "
                     f"{', '.join(_TRACE_SCALE)}")
  scale = _TRACE_SCALE[time_unit]
  rows = _rows(events)
  index = {r: i for i, r in enumerate(rows)}
  trace = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "stalepipe"}}]
  for r, i in index.items():
    trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i,
                  "args": {"name": r}})
    trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i,
                  "args": {"sort_index": i}})
  for e in events:
    trace.append({"name": f"{e.kind} {e.label}".strip(), "cat": _NAMES[e.kind],
                  "ph": "X", "pid": 0, "tid": index[e.row],
                  "ts": e.start * scale, "dur": e.duration * scale,
                  "args": {"kind": e.kind, "label": e.label,
                           "time_unit": time_unit}})
  out = {"traceEvents": trace, "displayTimeUnit": "ms"}
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return out
