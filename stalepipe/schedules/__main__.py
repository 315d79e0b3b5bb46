"""Command line: print, draw and export a schedule.

  python -m stalepipe.schedules show timeprest --stages 4 --microbatches 2 \\
      [--minibatches 6] [--png F] [--trace F]

  python -m stalepipe.schedules show interleaved-1f1b --stages 8 --devices 4 \\
      --microbatches 8

prints the task table (stages as rows, ticks as columns; `F3.1` is the
forward of minibatch 3 micro-batch 1, `B3` a backward, `FB3` a fused one,
`BI3.1` / `BW3.1` the input- and weight-gradient parts of a split backward,
`.` an idle tick), the version map and the derived figures; `--png` writes a
Gantt chart, `--trace` a Chrome/Perfetto trace. A device-level schedule
(interleaved-1f1b, looped-bfs, zb-v, dualpipev) prints one row per device,
each cell naming the chunk (the stage's slot on the device) after the kind:
`F1:0.3` is the forward of micro-batch 3 on the device's chunk 1, and
`F0:0.5+B1:0.2` an overlapped forward-and-backward unit.
"""

import argparse
import sys

from stalepipe import schedules


def table(schedule: schedules.Schedule) -> str:
  """The task table as text: one row per stage (per device where the
  schedule has a placement), one column per tick."""
  events = schedules.schedule_events(schedule)
  lane = "stage" if schedule.placed is None else "device"
  rows = {}
  for event in events:
    rows.setdefault(int(event.row.split()[1]),
                    ["."] * schedule.num_ticks)
  for task, event in zip(schedule.tasks, events):
    cells = rows[int(event.row.split()[1])]
    cell = f"{task.kind}{event.label}"
    begun = cells[task.tick] not in (".", "~")  # an overlapped pair
    cells[task.tick] = f"{cells[task.tick]}+{cell}" if begun else cell
    for tick in range(task.tick + 1, schedule.end_tick(task)):
      if cells[tick] == ".":
        cells[tick] = "~"
  width = max(len(c) for cells in rows.values() for c in cells)
  head = f"{'tick':<{len(lane) + 3}}" + " ".join(
      f"{t:>{width}}" for t in range(schedule.num_ticks))
  lines = [f"{lane} {r:<2}" + " ".join(f"{c:>{width}}" for c in rows[r])
           for r in sorted(rows)]
  return "\n".join([head] + lines)


def versions(schedule: schedules.Schedule) -> str:
  """The version map as text, one line per stage: `task:version`."""
  lines = []
  for s in range(schedule.num_stages):
    items = [f"{t.kind}{label}:{schedule.task_version(t)}"
             for t, label in zip(schedule.tasks,
                                 (e.label for e in
                                  schedules.schedule_events(schedule)))
             if t.stage == s]
    lines.append(f"stage {s:<2}" + " ".join(items))
  return "\n".join(lines)


def summary(schedule: schedules.Schedule) -> str:
  """The derived figures, one per line (per device too where placed)."""
  lines = [
      f"num_ticks          {schedule.num_ticks}",
      f"bubble_fraction    {schedule.bubble_fraction:.4f}",
      f"max_in_flight      {schedule.max_in_flight}",
      f"stash_depth        {schedule.stash_depth}",
      f"staleness          {schedule.staleness}",
      f"version_difference {schedule.version_difference}",
  ]
  if schedule.placed is not None:
    lines += [
        f"placement          {schedule.placement}, "
        f"devices {schedule.placed.stages.tolist()}",
        f"device_bubble      {schedule.device_bubble_fraction:.4f}",
        f"device_in_flight   {schedule.device_max_in_flight}",
        f"device_stash_depth {schedule.device_stash_depth}",
    ]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m stalepipe.schedules")
  sub = parser.add_subparsers(dest="command", required=True)
  show = sub.add_parser("show", help="print, draw and export a schedule")
  show.add_argument("name", choices=schedules.names())
  show.add_argument("--stages", type=int, default=4)
  show.add_argument("--microbatches", type=int, default=1)
  show.add_argument("--minibatches", type=int, default=None,
                    help="default: 1 for the synchronous gpipe, 1f1b, zb-h1 "
                    "and zb-h2, else 2 * stages")
  show.add_argument("--concurrent-minibatches", type=int, default=None,
                    help="hetpipe's N_m (default: stages)")
  show.add_argument("--vertical-sync", action="store_true",
                    help="pipedream with vertical sync")
  show.add_argument("--no-weight-stashing", action="store_true",
                    help="pipedream: a backward reads the latest weights")
  show.add_argument("--devices", type=int, default=None,
                    help="P, for interleaved-1f1b and looped-bfs (default: "
                    "stages / 2)")
  show.add_argument("--png", help="write a Gantt chart to this PNG file")
  show.add_argument("--trace", help="write a Chrome/Perfetto JSON trace")
  args = parser.parse_args(argv)

  kwargs = {}
  if args.name == "hetpipe":
    kwargs["concurrent_minibatches"] = (args.concurrent_minibatches
                                        or args.stages)
  if args.name == "pipedream":
    kwargs["vertical_sync"] = args.vertical_sync
    kwargs["weight_stashing"] = not args.no_weight_stashing
  if schedules.takes_num_devices(args.name):
    kwargs["num_devices"] = args.devices or max(1, args.stages // 2)
  minibatches = args.minibatches or (
      1 if args.name in ("gpipe", "1f1b", "zb-h1", "zb-h2",
                         "interleaved-1f1b", "looped-bfs", "zb-v", "dualpipev")
      else 2 * args.stages)
  try:
    schedule = schedules.make(args.name, num_stages=args.stages,
                              num_microbatches=args.microbatches,
                              num_minibatches=minibatches, **kwargs)
  except ValueError as e:
    parser.error(str(e))
  schedule.validate()
  title = (f"{args.name}: S={args.stages}, M={args.microbatches}, "
           f"B={minibatches}" + "".join(f", {k}={v}"
                                        for k, v in kwargs.items()))
  print(title)
  print(table(schedule))
  print("versions (task:version)")
  print(versions(schedule))
  print(summary(schedule))
  events = schedules.schedule_events(schedule)
  if args.png:
    schedules.gantt_png(events, args.png, title=title)
    print(f"wrote {args.png}")
  if args.trace:
    schedules.chrome_trace(events, args.trace)
    print(f"wrote {args.trace}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
