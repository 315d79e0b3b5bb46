"""The simulator's walk when groups form by arrival, across iterations.

Under `sdpipe(..., grouping="arrival")` (seed 002 Algorithms 1-2) a stage's
group may hold a worker after iteration k and another after iteration k + 1,
so the pipelines no longer meet once per minibatch and cannot be walked task
by task all at once (`engine._walk`). Here every worker (a stage of a
pipeline) runs its stage's tasks on its own, by the engine's rules, until a
task needs a version its group has not yet applied or an input another
worker has not yet produced. Each update's end is a ready signal to the
runner's scheduler, sent once the worker's group of the update before has
averaged (Algorithm 1: step B of one iteration before the next's; only a
stage that closes updates one after another without a forward between
them, as an asynchronous schedule drains, holds a signal back for it).

Once every worker waits, the earliest decision the signals fix is taken
(`grouping.ArrivalScheduler`): no signal can come earlier, since every task
still to run waits, directly or through its inputs, for a group not yet
sent, so it starts after that group's decision, and the task that closes an
update, with its step, takes time (`walk_by_arrival` refuses one that does
not). A group sent resumes its members when its averaging ends.

The walk yields each version's `applied` time per worker and each update's
end; the engine then walks the run once more with them (as it replays
recorded syncs) for waits and task times, with the same operations on the
same numbers.

References:
  Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023,
  §3.1-3.2 (Algorithms 1-2)
"""

import math

import numpy as np

from stalepipe.sim import policy as policy_lib


def walk_by_arrival(walk, runner, delay, scale, update, applied: np.ndarray,
                    local_end: np.ndarray) -> tuple[list, list]:
  """Runs every worker by arrival, filling `applied` and `local_end`.

  Args:
    walk: the engine's `_Walk` of the schedule.
    runner: a runner that `crosses_iterations` (`signal`, `next`,
      `decide`).
    delay, scale, update: `[B, S, N]`, as `engine.start_run` returns them.
    applied: `[S, B + 1, N]`, version 0 in place at 0, the rest inf;
      filled.
    local_end: `[S, B, N]`, when each update ends; filled.

  Returns:
    `(comm, groups)`: `[(stage, CommEvent)]` of every group of two or more,
    and per stage the groups sent, in time order (`grouping.Arrival`).

  Raises:
    ValueError: a task that closes an update, with its step, takes no time.
    RuntimeError: the workers stop with updates left (a deadlock).
  """
  plan = walk.plan
  S, _, N = applied.shape
  closing = np.flatnonzero(plan.trigger)
  p, s = plan.minibatch[closing], plan.stage[closing]
  if (plan.base[closing, None] * scale[p, s] + update[p, s] <= 0).any():
    raise ValueError("grouping by arrival needs every update's last task "
                     "and step to take time; valid: positive stage costs")
  order = [np.flatnonzero(plan.stage == s).tolist() for s in range(S)]
  pos = np.empty(len(plan.stage), np.int64)
  for tasks in order:
    pos[tasks] = np.arange(len(tasks))
  pos, dep = pos.tolist(), plan.dep.tolist()
  stage, minibatch, link = walk.stage, walk.minibatch, walk.link
  version, first, own, trigger = (walk.version, walk.first, walk.own,
                                  walk.trigger)
  base, checks = walk.base, walk.checks
  inf = math.inf
  versions = [[applied[s, :, i].tolist() for i in range(N)]
              for s in range(S)]  # [S][N][B + 1]
  ends = [[0.0] * len(stage) for _ in range(N)]  # each task's end
  ready = [[[0.0] * applied.shape[1] for _ in range(N)] for _ in range(S)]
  delay, scale, update = (np.transpose(x, (2, 0, 1)).tolist()
                          for x in (delay, scale, update))  # [N][B][S]
  links = walk.links.T.tolist()  # [N][L]
  done = [[0] * N for _ in range(S)]  # tasks each worker has run
  held = [[[] for _ in range(N)] for _ in range(S)]  # updates whose signal
  #   waits for the group before
  free = [[0.0] * N for _ in range(S)]

  def run(s: int, i: int) -> bool:
    """Runs worker (s, i) until it waits; whether it ran anything."""
    tasks, k, f = order[s], done[s][i], free[s][i]
    have, end = versions[s][i], ends[i]
    start = k
    while k < len(tasks):
      t = tasks[k]
      d = dep[t]
      if ((first[t] and have[own[t]] == inf)
          or (link[t] >= 0 and pos[d] >= done[stage[d]][i])
          or (checks[t] and have[version[t]] == inf)):
        break
      p = minibatch[t]
      if first[t]:
        f = max(f, have[own[t]]) + delay[i][p][s]
      st = max(f, end[d] + links[i][link[t]]) if link[t] >= 0 else f
      if checks[t]:
        st = max(st, have[version[t]])
      end[t] = f = st + scale[i][p][s] * base[t]
      if trigger[t]:  # the step, then the ready signal
        f = ready[s][i][p] = f + update[i][p][s]
        if have[p] == inf:
          held[s][i].append(p)
        else:
          runner.signal(s, i, p, max(f, have[p]))
      k += 1
    done[s][i], free[s][i] = k, f
    return k > start

  comm, groups = [], [[] for _ in range(S)]
  waiting = [(s, i) for s in range(S) for i in range(N)]
  while True:
    while waiting:
      s, i = waiting.pop()
      if run(s, i):  # its neighbours may wait on its outputs
        waiting.extend((r, i) for r in (s - 1, s + 1) if 0 <= r < S)
    decision = runner.next()
    if decision is None:
      break
    s = decision[1]
    out = runner.decide(s)
    if out is None:
      continue
    group, end = out
    groups[s].append(group)
    for m, k in zip(group.members.tolist(), group.iterations.tolist()):
      have = versions[s][m]
      have[k + 1] = max(end, have[k])
      waiting.append((s, m))
      if held[s][m] and held[s][m][0] == k + 1:
        held[s][m].pop(0)
        runner.signal(s, m, k + 1, max(ready[s][m][k + 1], have[k + 1]))
    if len(group.members) > 1:
      comm.append((s, policy_lib.CommEvent(
          group.members, np.full(len(group.members), group.close),
          np.full(len(group.members), end))))
  left = [(s, i) for s in range(S) for i in range(N)
          if done[s][i] < len(order[s])]
  if left:
    raise RuntimeError(f"workers (stage, pipeline) {left[:4]} stopped with "
                       "tasks left under grouping by arrival")
  applied[:] = np.array(versions).transpose(0, 2, 1)
  local_end[:] = np.array(ready)[:, :, :-1].transpose(0, 2, 1)
  return comm, groups
