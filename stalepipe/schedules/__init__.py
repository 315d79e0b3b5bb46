"""Pipeline schedules as data (DESIGN.md, "schedules as data").

Examples:
  >>> import stalepipe as sp
  >>> s = sp.schedules.make("gpipe", num_stages=4, num_microbatches=4)
  >>> s.tasks[0]
  Task(tick=0, stage=0, kind='F', minibatch=0, microbatch=0)
"""

import dataclasses
import inspect

from stalepipe import registry
from stalepipe.schedules import kinds
from stalepipe.schedules.core import KINDS, Schedule, Task
from stalepipe.schedules.dualpipev import dualpipev
from stalepipe.schedules.gpipe import gpipe
from stalepipe.schedules.hetpipe import hetpipe
from stalepipe.schedules.hetpipe import measured_global_staleness
from stalepipe.schedules.interleaved import interleaved_1f1b
from stalepipe.schedules.looped_bfs import looped_bfs
from stalepipe.schedules.one_f_one_b import one_f_one_b
from stalepipe.schedules.pipedream import pipedream
from stalepipe.schedules.pipedream_2bw import pipedream_2bw
from stalepipe.schedules.pipedream_interleaved import pipedream_interleaved
from stalepipe.schedules.pipedream_v import pipedream_v
from stalepipe.schedules.render import TimelineEvent
from stalepipe.schedules.render import chrome_trace
from stalepipe.schedules.render import gantt_png
from stalepipe.schedules.render import schedule_events
from stalepipe.schedules.timeprest import timeprest
from stalepipe.schedules.zero_bubble import zb_async
from stalepipe.schedules.zero_bubble import zb_h1
from stalepipe.schedules.zero_bubble import zb_h2
from stalepipe.schedules.zb_v import zb_v

PARTS = registry.Registry("schedule", {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
    "2bw": pipedream_2bw,
    "hetpipe": hetpipe,
    "timeprest": timeprest,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-async": zb_async,
    "interleaved-1f1b": interleaved_1f1b,
    "looped-bfs": looped_bfs,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
    "pipedream-interleaved": pipedream_interleaved,
    "pipedream-v": pipedream_v,
}, filled=("num_stages", "num_microbatches", "num_minibatches",
           "num_devices"))  # a config names num_chunks; the run fills P
# Device-level schedules: each names its placement (`Schedule.placement`),
# and a device runs one task per tick (the executor places them so:
# `placement.for_schedule`).
DEVICE_LEVEL = ("interleaved-1f1b", "looped-bfs", "zb-v", "dualpipev",
                "pipedream-interleaved", "pipedream-v")


def names() -> tuple[str, ...]:
  """The names `make` accepts."""
  return PARTS.names()


def takes_num_devices(name: str) -> bool:
  """Whether `name` is built for a number of devices (`num_devices`, filled
  by a run from num_stages / num_chunks): the loop schedules; a V schedule
  holds two chunks a device."""
  return "num_devices" in inspect.signature(PARTS.factory(name)).parameters


def make(name: str, *, num_stages: int, num_microbatches: int,
         num_minibatches: int = 1, **kwargs) -> Schedule:
  """Builds the schedule registered under `name`.

  Args:
    name: one of `names()`.
    num_stages: S, pipeline stages (at least 1).
    num_microbatches: M, micro-batches per minibatch (at least 1).
    num_minibatches: B, minibatches in the table (at least 1).
    **kwargs: schedule-specific options (e.g. `concurrent_minibatches`).

  Returns:
    The schedule.
  """
  PARTS.factory(name)
  for arg, value in (("num_stages", num_stages),
                     ("num_microbatches", num_microbatches),
                     ("num_minibatches", num_minibatches)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{arg}={value!r} is invalid; it must be an integer >= 1")
  schedule = PARTS.make(name, num_stages=num_stages,
                        num_microbatches=num_microbatches,
                        num_minibatches=num_minibatches, **kwargs)
  return dataclasses.replace(schedule, options=dict(kwargs))
