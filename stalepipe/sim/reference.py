r"""The reference simulator: one NumPy step per task, plain and obviously right.

It is the oracle the fast engine (`stalepipe.sim.engine`) is tested against,
event for event, as `stalepipe.pipeline.reference` is for the executor.

The rules (when a task starts and ends, what a sync does) are those of
`stalepipe.sim.engine`; here each task is one NumPy step over all pipelines
with nothing skipped, link delays are one row per task, and observed
staleness keeps the full `know[s][i, j]` matrix of every stage. A
device-level schedule's chunks share their device's free time; an overlapped
pair's tasks start at the later of their two starts.
"""

from typing import Sequence

import numpy as np

from stalepipe.schedules import core
from stalepipe.schedules import kinds
from stalepipe.sim import cluster as cluster_lib
from stalepipe.sim import engine
from stalepipe.sim import result as result_lib


def _compile(schedule: core.Schedule,
             costs: cluster_lib.StageCosts) -> engine.Program:
  S, B = schedule.num_stages, schedule.num_minibatches
  tasks = schedule.tasks
  T = len(tasks)
  fwd, bwd = {}, {}
  for i, t in enumerate(tasks):
    if schedule.kind(t).runs_forward:
      fwd[(t.minibatch, t.microbatch, t.stage)] = i
    if kinds.INPUT_COTANGENT in schedule.kind(t).produces:
      bwd[(t.minibatch, t.microbatch, t.stage)] = i
  plan = {k: np.full(T, -1) for k in ("stage", "minibatch", "dep", "boundary",
                                      "version")}
  volume, base = np.zeros(T), np.zeros(T)
  first, trigger = np.zeros(T, bool), np.zeros(T, bool)
  backward_version = np.full((S, B), np.iinfo(np.int64).max)
  first_task = np.full((S, B), -1)
  last_backward = np.full((S, B), -1)
  own, triggered = np.zeros(T, int), [0] * S
  placed = schedule.placed
  device = [s if placed is None else placed.where(s)[0] for s in range(S)]
  for i, t in enumerate(tasks):
    s, p, m = t.stage, t.minibatch, t.microbatch
    plan["stage"][i], plan["minibatch"][i] = s, p
    plan["version"][i] = v = schedule.task_version(t)
    if first_task[s, p] < 0:
      first_task[s, p], first[i] = i, True
    kind, covered = schedule.kind(t), schedule.covered_microbatches(t)
    base[i] = costs.seconds(kind, s) * len(covered)
    if kind.runs_forward and s > 0:
      dep, plan["boundary"][i], volume[i] = fwd.get((p, m, s - 1)), s - 1, 1
    elif kinds.OUTPUT_COTANGENT in kind.consumes and s < S - 1:
      dep, plan["boundary"][i] = bwd.get((p, m, s + 1)), s
      volume[i] = len(covered)
    elif not kind.runs_forward:
      dep = fwd.get((p, covered[-1], s))
    else:  # a forward on stage 0 reads the data
      dep = -1
    b = plan["boundary"][i]
    if b >= 0 and device[b] == device[b + 1]:
      plan["boundary"][i], volume[i] = -1, 0  # same device: no link
    if dep != -1:
      if dep is None or dep >= i:
        raise ValueError(f"{t} of schedule {schedule.name!r} runs before the "
                         "task whose output it needs")
      plan["dep"][i] = dep
    if kind.closes_update:
      last_backward[s, p] = i
    if kind.runs_backward:
      backward_version[s, p] = min(backward_version[s, p], v)
  trigger[last_backward[last_backward >= 0]] = True
  engine.check_update_order(last_backward, schedule.name)
  for i, t in enumerate(tasks):
    own[i] = triggered[t.stage]
    triggered[t.stage] += int(trigger[i])
    v = plan["version"][i]
    if v > 0 and last_backward[t.stage, v - 1] >= i:
      raise ValueError(f"{t} reads version {v} before stage {t.stage} applies "
                       f"the update of minibatch {v - 1}")
  return engine.Program(volume=volume, first=first, own=own, trigger=trigger,
                        base=base, cost_class=None,
                        backward_version=backward_version,
                        first_task=first_task,
                        device=np.array(device)[plan["stage"]],
                        lead=engine.pairs(schedule, trigger), **plan)


def simulate(schedule: core.Schedule, cluster: cluster_lib.Cluster,
             costs: cluster_lib.StageCosts,
             policy=None, *,
             perturbations: Sequence = (), seed: int = 0
             ) -> result_lib.SimResult:
  """`stalepipe.sim.simulate`, one NumPy step per task (same arguments)."""
  policy, runner, delay, scale, update, chunks = engine.start_run(
      schedule, cluster, costs, policy, perturbations, seed)
  if runner.crosses_iterations:
    raise ValueError(f"sync policy {policy.name!r} groups workers across "
                     "iterations, which this simulator's per-minibatch syncs "
                     "cannot time; valid: stalepipe.sim.simulate")
  S, B, N = schedule.num_stages, schedule.num_minibatches, cluster.num_pipelines
  plan = _compile(schedule, costs)
  xfer = _transfers(plan, chunks, costs)

  T = len(plan.stage)
  start, end = np.zeros((T + 1, N)), np.zeros((T + 1, N))
  ready = np.zeros((T, N))
  blocked, sleep_at, sleep, together = (np.zeros((T, N)) for _ in range(4))
  P = int(plan.device.max()) + 1
  free = np.zeros((P, N))
  earlier = set(plan.lead[plan.lead >= 0].tolist())
  applied = np.full((S, B + 1, N), np.inf)
  applied[:, 0] = 0.0
  local_end = np.zeros((S, B, N))
  # know[s][i, j]: updates of replica j that replica i's stage s reflects,
  # kept for the versions a later backward may still read (a ring buffer).
  know = np.zeros((S, N, N), dtype=np.int64)
  depth = int((np.arange(1, B + 1)[None] - plan.backward_version).max()) + 1
  history = np.zeros((S, depth, N, N), dtype=np.int64)
  reflected = np.zeros((S, B, N), dtype=np.int64)
  diagonal = np.arange(N)
  comm = []
  stage, minibatch, dep = plan.stage.tolist(), plan.minibatch.tolist(), plan.dep
  version, first, trigger = plan.version.tolist(), plan.first, plan.trigger
  base, gates, own = plan.base, runner.gates, plan.own
  for i in range(T):
    s, p, d, j = stage[i], minibatch[i], plan.device[i], plan.lead[i]
    f = free[d]
    if first[i]:
      synced = np.maximum(f, applied[s, own[i]])
      blocked[i], sleep_at[i], sleep[i] = synced - f, synced, delay[p, s]
      f = synced + sleep[i]
    r = np.maximum(f, end[dep[i]] + xfer[i])
    st = np.maximum(r, applied[s, version[i]])
    if gates and first[i]:
      st = np.maximum(st, runner.gate(s, p))
    if j >= 0:  # an overlapped pair: both start when both are ready; the
      # one that waits for the other idles
      both = np.maximum(st, start[j])
      together[i], together[j], start[j] = both - st, both - start[j], both
      st = both
      end[j] = st + base[j] * scale[minibatch[j], stage[j]]
    e = st + base[i] * scale[p, s]
    ready[i], start[i], end[i] = r, st, e
    if i in earlier:
      free[d] = f
      continue
    if not trigger[i]:
      free[d] = e if j < 0 else np.maximum(e, end[j])
      continue
    e = e + update[p, s]
    free[d] = local_end[s, p] = e
    out = runner.sync(s, p, e)
    applied[s, p + 1] = np.maximum(out.applied, applied[s, p])
    read = history[s, plan.backward_version[s, p] % depth]
    floor = runner.floor(s, start[plan.first_task[s, p]])
    reflected[s, p] = np.maximum(read, floor[:, None]).sum(axis=1)
    k = know[s]
    k[diagonal, diagonal] = p + 1
    for g in out.groups:
      k[g] = k[g].max(axis=0)
    history[s, (p + 1) % depth] = k
    comm.extend((s, c) for c in out.comm)

  start, end = start[:T], end[:T]
  busy = np.zeros((S, N))
  wait = np.zeros((S, N))
  for s in range(S):
    mine = plan.stage == s
    busy[s] = (end[mine] - start[mine]).sum(0)
    wait[s] = (start[mine] - ready[mine] + blocked[mine]
               - together[mine]).sum(0)
  return engine.finish_run(
      schedule, cluster, costs, policy, runner,
      task_times=result_lib.TaskTimes(start, end, ready, blocked, sleep_at,
                                      sleep),
      end_max=end.max(), applied=applied, local_end=local_end,
      reflected=reflected, busy=busy, wait=wait, delay=delay, update=update,
      comm=comm, overlap=_overlap(plan, start, end, P))


def _overlap(plan: engine.Program, start: np.ndarray, end: np.ndarray,
             P: int) -> np.ndarray:
  """`[P, N]` seconds each device ran both tasks of its overlapped pairs."""
  overlap = np.zeros((P, start.shape[1]))
  for j, i in zip(plan.lead[plan.lead >= 0], np.flatnonzero(plan.lead >= 0)):
    overlap[plan.device[i]] += np.minimum(end[i] - start[i], end[j] - start[j])
  return overlap


def _transfers(plan: engine.Program, cluster: cluster_lib.Cluster,
               costs: cluster_lib.StageCosts) -> np.ndarray:
  """`[T, N]` seconds each task's input spends on the link (0 without one)."""
  N = cluster.num_pipelines
  latency, bandwidth = engine.link_grid(cluster)
  xfer = np.zeros((len(plan.stage), N))
  has = plan.boundary >= 0
  b = plan.boundary[has]
  volume = plan.volume[has] * np.asarray(costs.activation_bytes)[b]
  xfer[has] = latency[b] + volume[:, None] / bandwidth[b]
  return xfer
