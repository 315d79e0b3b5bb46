r"""A sync policy that replays a simulated run of the same run (seed 002 §5.3).

The lock-step executor runs every replica at the same pace, so a straggler
cannot be slow in it; heterogeneity enters as a trace. `simulated(N,
policy, ...)` builds the named policy, times the run (its schedule over all
`num_steps` minibatches, on a named cluster with stragglers) with
`stalepipe.sim.simulate`, and returns the policy replaying what that
simulated cluster decided:

- `bsp`: the gradient all-reduce, nothing to replay;
- `sdpipe`: the scheduler fed the simulated ready times (each stage's update
  of each minibatch in place on each replica, `SimResult.applied_local`), so
  it forms the groups the simulator formed;
- `ad_psgd`: the pairs the simulated run averaged (`Replayed`);
- `wsp`: per wave and worker the delay with which it saw the global update,

  .. math:: \delta_{c,d} = c + 1 - |\{c' : v_{c'} \le t_{d,c}\}|,
     \quad 0 \le \delta_{c,d} \le D,

  :math:`t_{d,c}` the time worker d's clock reaches c + 1 and :math:`v_{c'}`
  the time global wave c' is in place on every stage.

The policy returned carries the simulated run's figures as `trace`
(`SimulatedTrace`): when each minibatch's update is in place everywhere, the
x-axis of a loss against simulated wall-clock. The simulator is imported
here, when a policy is built, never by the executor.

Examples:
  >>> import stalepipe as sp
  >>> s = sp.schedules.make("1f1b", num_stages=2, num_microbatches=2,
  ...                       num_minibatches=4)
  >>> p = sp.sync.make("simulated", num_replicas=2, policy="bsp",
  ...                  schedule=s, num_steps=8, stragglers="hete-B")
  >>> p.name, p.trace.seconds.shape
  ('bsp', (8,))

References:
  Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023, §5.3;
  Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §5
"""

from typing import Any, Mapping, NamedTuple

import numpy as np

from stalepipe.sync import base

POLICIES = ("bsp", "wsp", "sdpipe", "ad_psgd")
# The simulator times every task of every pipeline before step 1, about 30 us
# and 1 kB a task on a CPU core: a million tasks is about 30 s.
MAX_SIMULATED_TASKS = 1_000_000
STRAGGLERS = ("homogeneous", "hete-A", "hete-B")  # seed 002 §5.1


class SimulatedTrace(NamedTuple):
  """What the simulated run measured, for the run's records."""

  seconds: np.ndarray  # float [B]: when minibatch p's update is in place on
  #   every stage of every pipeline (B = the run's num_steps)
  staleness: float  # mean observed staleness per replica, in updates
  skipped: int  # SDPipe's validations skipped by deadlock prevention


class Replayed(base.SyncPolicy):
  """Group averaging replayed from a simulated run (AD-PSGD's pairs).

  After the update of minibatch p on stage s, the replicas average their new
  weights within the groups the simulator formed for that stage and
  iteration, :math:`x \\leftarrow W x` with `W = group_mixing(groups[s][p])`.

  References:
    Miao et al, SDPipe <https://doi.org/10.14778/3598581.3598604>, 2023,
    §3.2 (eq. 1-2); Lian et al, AD-PSGD <https://arxiv.org/abs/1710.06952>,
    2018
  """

  name = "replayed"

  def __init__(self, num_replicas: int, groups):
    super().__init__(num_replicas)
    self.groups = groups  # [stage][iteration] -> list of member arrays

  def mixing(self, stage: int, minibatch: int) -> np.ndarray | None:
    if minibatch >= len(self.groups[stage]):
      return None
    return base.group_mixing(self.groups[stage][minibatch], self.num_replicas)


def update_order(schedule) -> list[tuple[int, int]]:
  """`(stage, minibatch)` of every update, in the order the simulator syncs:
  at a minibatch's last backward on a stage, in schedule order."""
  last = {}
  for i, t in enumerate(schedule.tasks):
    if t.kind in ("B", "FB"):
      last[(t.stage, t.minibatch)] = i
  return sorted(last, key=last.get)


def ad_psgd_groups(result) -> list[list[list[np.ndarray]]]:
  """`[stage][iteration]` the pairs a simulated AD-PSGD run averaged, each
  checked against that update's ready times."""
  order = update_order(result.schedule)
  if len(order) != len(result.comm):
    raise ValueError(f"{len(result.comm)} exchanges for {len(order)} updates; "
                     "valid: one per update")
  ready = result.applied_local  # [S, B, N]
  groups = [[None] * result.schedule.num_minibatches
            for _ in range(result.schedule.num_stages)]
  for (s, p), (stage, event) in zip(order, result.comm):
    pairs = event.pipelines.reshape(-1, 2)
    if stage != s or not np.allclose(event.start[::2],
                                     ready[s, p][pairs].max(axis=1)):
      raise ValueError(f"exchange on stage {stage} does not match the update "
                       f"of minibatch {p} on stage {s}")
    groups[s][p] = list(pairs)
  return groups


def wsp_delays(result, clock_distance: int) -> np.ndarray:
  """`[waves, N]`: how many waves behind each worker saw the global update
  (the module's formula), checked against the bound D."""
  clock = result.extras["wsp_clock_times"]  # [N, waves]
  visible = result.extras["wsp_global_visible"].max(axis=0)  # [waves]
  seen = np.searchsorted(visible, clock, side="right")
  delay = np.arange(clock.shape[1])[None] + 1 - seen
  if delay.max() > clock_distance:
    raise ValueError(f"a worker saw a global wave {delay.max()} waves late; "
                     f"valid: at most D={clock_distance}")
  return np.maximum(delay, 0).T


def _long_schedule(schedule, num_steps: int):
  """`schedule` over the run's `num_steps` minibatches (tiled: the same as
  building it directly, in linear time)."""
  from stalepipe import sim  # pylint: disable=g-import-not-at-top
  waves = schedule.options.get("concurrent_minibatches", 1)
  pattern = min(num_steps, max(24, 4 * waves + 8))
  try:
    return sim.tile(schedule.with_minibatches(pattern), num_steps)
  except ValueError:  # no steady state within the pattern
    return schedule.with_minibatches(num_steps)


def _replaying(numeric: base.SyncPolicy, result) -> base.SyncPolicy:
  """`numeric` replaying what the simulated run `result` decided."""
  from stalepipe import sync  # pylint: disable=g-import-not-at-top
  N = numeric.num_replicas
  if numeric.name == "wsp":
    return sync.wsp(N, numeric.clock_distance, numeric.wave,
                    delays=wsp_delays(result, numeric.clock_distance),
                    server=numeric.server)
  if numeric.name == "sdpipe":
    return sync.sdpipe(N, numeric.history, numeric.window,
                       ready_times=result.applied_local.transpose(1, 0, 2),
                       enforce=numeric.enforce, min_size=numeric.min_size,
                       history_unit=numeric.history_unit)
  if numeric.name == "ad_psgd":
    return Replayed(N, ad_psgd_groups(result))
  return numeric  # BSP: nothing to replay


def simulated(num_replicas: int, policy: str,
              policy_kwargs: Mapping[str, Any] | None = None,
              cluster: str = "resnet50_10gbe", stragglers: str = "homogeneous",
              seed: int = 0, schedule=None, num_steps: int | None = None
              ) -> base.SyncPolicy:
  """`policy`, replaying a simulation of this run (see the module).

  Args:
    num_replicas: N, the pipelines.
    policy: the sync policy simulated and replayed, one of `POLICIES`.
    policy_kwargs: its arguments, as `stalepipe.sync.make` takes them. For
      `sdpipe`, `window` defaults to 1/N of the simulated iteration without
      stragglers (seed 002 §5.1); for `ad_psgd`, without `seed` the
      simulator draws the pairs from the run's seeded stream.
    cluster: where the run is timed, a name of `stalepipe.sim.clusters`.
    stragglers: one of `STRAGGLERS`: none (homogeneous), or each worker
      sleeping 0.1 s (hete-A) / 0.3 s (hete-B) with probability 10% per
      iteration (seed 002 §5.1).
    seed: seeds the simulated stragglers (and AD-PSGD's pairs).
    schedule: the run's schedule (filled in by the run: `build.parts`).
    num_steps: minibatches the run trains (filled in by the run).

  Returns:
    The policy, with `trace` (`SimulatedTrace`) set.
  """
  from stalepipe import sim  # pylint: disable=g-import-not-at-top
  from stalepipe import sync  # pylint: disable=g-import-not-at-top
  if schedule is None or num_steps is None:
    raise ValueError("sync policy 'simulated' needs the run's schedule and "
                     "num_steps; valid: built by a run (build.parts) or given")
  for arg, value, valid in (("policy", policy, POLICIES),
                            ("stragglers", stragglers, STRAGGLERS),
                            ("cluster", cluster, sim.clusters.names())):
    if value not in valid:
      raise ValueError(f"{arg}={value!r} is invalid; valid: "
                       f"{', '.join(valid)}")
  if not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed={seed!r} is invalid; valid: an integer >= 0")
  kwargs = dict(policy_kwargs or {})
  N, S = num_replicas, schedule.num_stages
  per_step = N * len(schedule.tasks) / schedule.num_minibatches
  if num_steps * per_step > MAX_SIMULATED_TASKS:
    raise ValueError(
        f"num_steps={num_steps} is invalid for sync 'simulated': it times "
        f"{num_steps * per_step:,.0f} tasks ({N} pipelines x "
        f"{per_step / N:g} tasks a minibatch) before step 1; valid: at most "
        f"{int(MAX_SIMULATED_TASKS // per_step)} steps "
        f"(MAX_SIMULATED_TASKS={MAX_SIMULATED_TASKS:,})")
  grid, costs = sim.clusters.make(cluster, num_pipelines=N, num_stages=S,
                                  num_microbatches=schedule.num_microbatches)
  run = _long_schedule(schedule, num_steps)
  if policy == "wsp":  # a wave is the schedule's N_m minibatches
    kwargs.setdefault("concurrent_minibatches",
                      schedule.options.get("concurrent_minibatches", 1))
  if policy == "sdpipe" and "window" not in kwargs:
    kwargs["window"] = sim.simulate(run, grid, costs).makespan / num_steps / N
  try:
    numeric = sync.make(policy, num_replicas=N, **kwargs)
    if policy == "sdpipe":  # the run replays it on the executor
      numeric.check_lockstep()
  except ValueError as e:
    raise ValueError(f"policy_kwargs of {policy!r}: {e}") from None
  timed = (sim.ad_psgd() if policy == "ad_psgd" and "seed" not in kwargs
           else numeric)
  perturbations = () if stragglers == "homogeneous" else (
      sim.hete(stragglers[-1]),)
  result = sim.simulate(run, grid, costs, timed, perturbations=perturbations,
                        seed=seed)
  numeric = _replaying(numeric, result)
  numeric.trace = SimulatedTrace(
      seconds=result.applied[:, 1:].max(axis=(0, 2)),
      staleness=float(result.staleness.mean() / N),
      skipped=len(result.extras.get("sdpipe_skipped", ())))
  return numeric
