"""Long schedules by tiling a short one's periodic steady state.

Simulating thousands of iterations needs a schedule over thousands of
minibatches. The greedy schedules are causal (adding minibatches never changes
what happens before the new ones enter) and settle into a steady state where
minibatch `p + 1` does exactly what `p` did, `period` ticks later, reading a
version one higher. `tile` finds that steady state in a short schedule and
repeats it: the warm-up minibatches are copied, the steady ones repeated, and
the drain (the last minibatches) shifted to the end. The result equals
building the long schedule directly (the tests check this), in time linear in
the number of minibatches.
"""

import collections

from stalepipe.schedules import core


def _signatures(schedule: core.Schedule):
  """Per minibatch: first tick and its tasks relative to it (tick, version)."""
  tasks = collections.defaultdict(list)
  for t in schedule.tasks:
    tasks[t.minibatch].append(t)
  first, signature = [], []
  for p in range(schedule.num_minibatches):
    t0 = min(t.tick for t in tasks[p])
    first.append(t0)
    signature.append(tuple(sorted(
        (t.tick - t0, t.stage, t.kind, t.microbatch,
         p - schedule.task_version(t)) for t in tasks[p])))
  return first, signature, tasks


def _steady(first, signature, K):
  """`(a, q, shift, b)`: minibatches a..b-1 repeat every q, shift ticks on."""
  for q in range(1, K // 3 + 1):
    same = [p for p in range(K - q) if signature[p] == signature[p + q]]
    if len(same) < q + 1 or same != list(range(same[0], same[-1] + 1)):
      continue
    shifts = {first[p + q] - first[p] for p in same}
    if len(shifts) == 1:
      return same[0], q, shifts.pop(), same[-1] + q
  return None


def tile(schedule: core.Schedule, num_minibatches: int) -> core.Schedule:
  """`schedule` stretched to `num_minibatches` by repeating its steady state.

  The steady state is a block of `q` minibatches that repeats, each copy
  `shift` ticks after the last and reading versions `q` higher.

  Args:
    schedule: a causal schedule long enough to show its steady state at
      least twice before its drain.
    num_minibatches: B of the result (at least `schedule.num_minibatches`).

  Returns:
    The schedule over `num_minibatches`.

  Examples:
    >>> import stalepipe as sp
    >>> short = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
    ...                           num_minibatches=8)
    >>> tile(short, 20).tasks == short.with_minibatches(20).tasks
    True
  """
  K = schedule.num_minibatches
  if num_minibatches < K:
    raise ValueError(f"num_minibatches={num_minibatches!r} is invalid; it must "
                     f"be >= the pattern's {K}")
  first, signature, tasks = _signatures(schedule)
  found = _steady(first, signature, K)
  if found is None:
    raise ValueError(f"schedule {schedule.name!r} over {K} minibatches shows "
                     "no steady state; build it over more minibatches")
  a, q, shift, b = found  # minibatches a..b-1 are steady
  extra = num_minibatches - K
  if extra % q:
    return tile(schedule.with_minibatches(K + extra % q), num_minibatches)
  # Each minibatch of the result is a minibatch of `schedule` moved by a
  # number of ticks, its versions raised by as many: (source, ticks, versions).
  moves = {p: (p, 0, 0) for p in range(b)}
  for p in range(b, b + extra):
    copies, src = divmod(p - a, q)
    moves[p] = (a + src, copies * shift, copies * q)
  for p in range(b, K):
    moves[p + extra] = (p, extra // q * shift, extra)
  moved = lambda t, p, dt: t._replace(tick=t.tick + dt, minibatch=p)  # pylint: disable=unnecessary-lambda-assignment
  out, versions = [], {}
  for p, (src, dt, dv) in moves.items():
    for t in tasks[src]:
      out.append(moved(t, p, dt))
      versions[(p, t.stage, t.kind, t.microbatch)] = schedule.task_version(t) + dv
  out.sort(key=lambda t: (t.tick, t.stage))
  pairs = {}  # a device-level schedule's overlapped units, per minibatch
  for f, b_ in schedule.overlapped:
    pairs.setdefault(f.minibatch, []).append((f, b_))
  overlapped = tuple((moved(f, p, dt), moved(b_, p, dt))
                     for p, (src, dt, _) in sorted(moves.items())
                     for f, b_ in pairs.get(src, ()))
  return core.Schedule(
      schedule.name, schedule.num_stages, schedule.num_microbatches,
      num_minibatches, tuple(out), versions, dict(schedule.durations),
      schedule.backward_covers_minibatch, dict(schedule.options),
      placement=schedule.placement, num_devices=schedule.num_devices,
      overlapped=overlapped)
