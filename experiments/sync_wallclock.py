"""Loss against simulated wall-clock for the sync policies under stragglers.

Seed 002 §5.3 (Figure 5) scaled down: BSP (All-Reduce+Pipe), WSP with
D in {0, 4, 32} (HetPipe), SDPipe and AD-PSGD (+Pipe) on 4 pipelines x 2
stages, homogeneous and under hete-A / hete-B stragglers (§5.1: each worker
sleeps 0.1 / 0.3 s with probability 10% per iteration).

Each run has two halves that see the same minibatches:

- time: `stalepipe.sim.simulate` runs the schedule and the policy's time side
  on the cluster with the stragglers and gives each minibatch's completion
  time (its update in place on every stage of every pipeline) and the trace
  of who saw what: SDPipe's groups per stage and iteration, AD-PSGD's pairs,
  WSP's clock and global-wave times;
- numerics: the lock-step shard_map executor (`Pipeline(..., sync=policy)`)
  trains a small MLP on digits with a policy that replays exactly that trace
  (`Replayed` for groups and pairs, `sp.sync.wsp(..., delays=)` for WSP) and
  reports the training loss per window.

Time side (seed 002 §5.1, as in `sim_sdpipe_fig4.py`): ResNet-50 costs (256
images per minibatch, 6 x 4.1 GMAC per image at 15 TFLOP/s, backward twice
the forward, parameters split evenly), 10 Gb Ethernet between nodes, NVLink-
class links inside one; each pipeline sits on its own 2-GPU node, so a
stage's replicas talk over Ethernet as in the paper's 4 x 4 run across two
8-GPU nodes. BSP, SDPipe (P = 10, T = 1/N of an iteration) and AD-PSGD run
PipeDream-Flush 1F1B (§5.1); WSP runs the `hetpipe` schedule with N_m = 4
concurrent minibatches and a parameter server behind one Ethernet link.

It stays a script, not configs run by launch.py: a run's sync policy is
built from a simulation of the same run (SDPipe's ready times, AD-PSGD's
pairs, WSP's wave delays), and its x-axis is the simulated time, so the
numerics depend on a trace no config field can name.

Usage (about a minute on 2 CPU cores; results in docs/sync.md; the table as
`<out_dir>/sync_wallclock.json`, the figure `sync_wallclock.png` beside it or,
with --write_figures, in docs/figures/):
  .venv/bin/python experiments/sync_wallclock.py [--minibatches=256] \
      [--out_dir=DIR] [--write_figures]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import time

from absl import flags
import jax
import numpy as np
import optax

import harness
import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor
# pylint: enable=g-import-not-at-top,wrong-import-position

STAGES, PIPELINES, MICRO, PER_MICRO = 2, 4, 2, 8  # M, N, micro-batches, b
MINIBATCHES = 256  # per pipeline
WINDOW = 8  # minibatches per executor step
CONCURRENT = 4  # N_m of the hetpipe schedule
LEARNING_RATE = 0.1
TARGET_LOSS = 0.15
SMOOTH = 4  # windows in the rolling mean behind the curves and the target
SEED = 0
SETTINGS = {"homogeneous": (), "hete-A": (sp.sim.hete("A"),),
            "hete-B": (sp.sim.hete("B"),)}
POLICIES = ("BSP", "WSP D=0", "WSP D=4", "WSP D=32", "SDPipe", "AD-PSGD")
ETHERNET = sp.sim.Link(10e9 / 8, 50e-6)
NVLINK = sp.sim.Link(100e9, 5e-6)
LEAST_MINIBATCHES = 4 * CONCURRENT + 8  # the tiled schedules' pattern

_MINIBATCHES = flags.DEFINE_integer(
    "minibatches", MINIBATCHES, "Minibatches per pipeline.",
    lower_bound=LEAST_MINIBATCHES)


class Replayed(sp.sync.SyncPolicy):
  """Group averaging replayed from a simulated run (AD-PSGD's pairs).

  After the update of minibatch p on stage s, the replicas average their new
  weights within the groups the simulator formed for that stage and
  iteration, `x <- W x` with `W = group_mixing(groups[s][p])`.

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
    return sp.sync.group_mixing(self.groups[stage][minibatch],
                                self.num_replicas)


def time_side():
  """The cluster and ResNet-50 stage costs of seed 002 §5.1 on M x N."""
  flops = 6 * 4.1e9 * 256
  per_micro = flops / 15e12 / STAGES / MICRO
  costs = sp.sim.StageCosts.uniform(
      STAGES, per_micro / 3, 2 * per_micro / 3,
      activation_bytes=256 * 512 * 28 * 28 * 4 / MICRO,
      param_bytes=25.6e6 * 4 / STAGES, samples_per_microbatch=256 // MICRO)
  cluster = sp.sim.Cluster.grid(PIPELINES, STAGES, devices_per_node=STAGES,
                                intra=NVLINK, inter=ETHERNET, ps=ETHERNET)
  return cluster, costs


def schedules(minibatches: int) -> dict:
  """Each schedule for one executor window and for the whole simulated run."""
  kwargs = {"1f1b": {}, "hetpipe": {"concurrent_minibatches": CONCURRENT}}
  out = {}
  for name, kw in kwargs.items():
    window = sp.schedules.make(name, num_stages=STAGES, num_microbatches=MICRO,
                               num_minibatches=WINDOW, **kw)
    short = sp.schedules.make(name, num_stages=STAGES, num_microbatches=MICRO,
                              num_minibatches=LEAST_MINIBATCHES, **kw)
    out[name] = (window, sp.sim.tile(short, minibatches))
  return out


def update_order(schedule) -> list[tuple[int, int]]:
  """`(stage, minibatch)` of every update, in the order the simulator syncs.

  The simulator syncs at the last backward of a minibatch on a stage, going
  through the tasks in schedule order (`sim/engine.py`).
  """
  last = {}
  for i, t in enumerate(schedule.tasks):
    if t.kind in ("B", "FB"):
      last[(t.stage, t.minibatch)] = i
  return sorted(last, key=last.get)


def ad_psgd_groups(result) -> list[list[list[np.ndarray]]]:
  """`[stage][iteration]` the pairs the simulated AD-PSGD run averaged."""
  order = update_order(result.schedule)
  if len(order) != len(result.comm):
    raise ValueError(f"{len(result.comm)} exchanges for {len(order)} updates; "
                     "valid: one per update")
  ready = result.applied_local  # [S, B, N]
  groups = [[None] * result.schedule.num_minibatches
            for _ in range(STAGES)]
  for (s, p), (stage, event) in zip(order, result.comm):
    pairs = event.pipelines.reshape(-1, 2)
    if stage != s or not np.allclose(event.start[::2],
                                     ready[s, p][pairs].max(axis=1)):
      raise ValueError(f"exchange on stage {stage} does not match the update "
                       f"of minibatch {p} on stage {s}")
    groups[s][p] = list(pairs)
  return groups


def wsp_delays(result, clock_distance: int) -> np.ndarray:
  r"""`[waves, N]`: how many waves behind each worker saw the global update.

  At the tick of worker d's local clock to c + 1 (wave c pushed and global
  wave c - D pulled, `extras["wsp_clock_times"]`) it holds the global waves
  already in place on every stage (`extras["wsp_global_visible"]`):

  .. math:: \delta_{c,d} = c + 1 - |\{c' : v_{c'} \le t_{d,c}\}|,
     \quad 0 \le \delta_{c,d} \le D

  References:
    Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, 2020, §5
  """
  clock = result.extras["wsp_clock_times"]  # [N, waves]
  visible = result.extras["wsp_global_visible"].max(axis=0)  # [waves]
  seen = np.searchsorted(visible, clock, side="right")
  delay = np.arange(clock.shape[1])[None] + 1 - seen
  if delay.max() > clock_distance:
    raise ValueError(f"a worker saw a global wave {delay.max()} waves late; "
                     f"valid: at most D={clock_distance}")
  return np.maximum(delay, 0).T


def simulate(policy_name: str, perturbations, scheds, cluster, costs,
             iteration: float):
  """`(completion [B] seconds, numeric policy, schedule name, result)`.

  SDPipe's numeric scheduler replays the simulated ready times (the update
  of each minibatch on each stage, `applied_local`); AD-PSGD replays the
  simulated pairs; WSP the delays `wsp_delays` derives.
  """
  if policy_name.startswith("WSP"):
    distance = int(policy_name.split("=")[1])
    name, sim_policy = "hetpipe", sp.sim.wsp(distance, CONCURRENT)
  else:
    name = "1f1b"
    sim_policy = {"BSP": sp.sim.bsp(), "AD-PSGD": sp.sim.ad_psgd(),
                  "SDPipe": sp.sim.sdpipe(10, iteration / PIPELINES)
                  }[policy_name]
  result = sp.sim.simulate(scheds[name][1], cluster, costs, sim_policy,
                           perturbations=perturbations, seed=SEED)
  if policy_name == "BSP":
    numeric = sp.sync.bsp(PIPELINES)
  elif policy_name.startswith("WSP"):
    # The mean server keeps WSP's step size equal to the other policies'
    # (the sum, HetPipe's, steps n times as far per wave): docs/sync.md.
    numeric = sp.sync.wsp(PIPELINES, distance, CONCURRENT,
                          delays=wsp_delays(result, distance), server="mean")
  elif policy_name == "SDPipe":
    ready = result.applied_local.transpose(1, 0, 2)  # [B, S, N]
    numeric = sp.sync.sdpipe(PIPELINES, 10, iteration / PIPELINES,
                             ready_times=ready)
  else:
    numeric = Replayed(PIPELINES, ad_psgd_groups(result))
  completion = result.applied[:, 1:].max(axis=(0, 2))
  return completion, numeric, name, result


def sdpipe_agreement(result, policy) -> float:
  """Share of (stage, iteration) where the numeric SDPipe, replaying the
  simulated ready times, averages the groups the simulator formed."""
  B = result.schedule.num_minibatches
  same = sum(np.array_equal(
      policy.mixing(s, p),
      sp.sync.group_mixing(result.extras["sdpipe_groups"][s][p], PIPELINES))
             for p in range(B) for s in range(STAGES))
  return same / (B * STAGES)


def batches(data, num_windows: int):
  """Windows `[WINDOW, M, N*b, 64]` drawn epoch by epoch (seeded)."""
  per_window = WINDOW * MICRO * PIPELINES * PER_MICRO
  rng = np.random.default_rng(SEED)
  order = np.concatenate([rng.permutation(len(data.x_train)) for _ in range(
      num_windows * per_window // len(data.x_train) + 1)])
  shape = (WINDOW, MICRO, PIPELINES * PER_MICRO)
  for k in range(num_windows):
    idx = order[k * per_window:(k + 1) * per_window]
    yield (data.x_train[idx].reshape(shape + (-1,)),
           data.y_train[idx].reshape(shape))


def accuracy(staged, stage_params, data) -> float:
  x = data.x_test
  for fn, params in zip(staged.stage_fns, stage_params):
    x = fn(params, x)
  return float((np.argmax(x, -1) == data.y_test).mean())


def train(pipe, policy, staged, data, num_windows: int):
  """Per-window training loss and the replicas' mean test accuracy."""
  pipe.sync = policy  # same policy class and D: the compiled step is reused
  state = pipe.init(staged.stage_params)
  losses = []
  for x, y in batches(data, num_windows):
    state, metrics = pipe.step(state, x, y)
    losses.append(float(metrics["loss"]))
  acc = np.mean([accuracy(staged, pipe.params(state, r), data)
                 for r in range(PIPELINES)])
  return np.array(losses), float(acc)


def smooth(losses: np.ndarray) -> np.ndarray:
  kernel = np.ones(SMOOTH) / SMOOTH
  padded = np.concatenate([np.full(SMOOTH - 1, losses[0]), losses])
  return np.convolve(padded, kernel, mode="valid")


def main(argv):
  del argv
  started = time.time()
  num_windows = _MINIBATCHES.value // WINDOW
  cluster, costs = time_side()
  scheds = schedules(num_windows * WINDOW)
  iteration = sp.sim.simulate(scheds["1f1b"][1], cluster,
                              costs).makespan / (num_windows * WINDOW)
  data = sp.data.digits()
  staged = sp.models.split(sp.models.mlp(64, 64, 1, data.num_classes,
                                         seed=SEED), STAGES)
  mesh = jax.make_mesh((PIPELINES, STAGES), ("data", "stage"))
  pipes = {}
  runs = {}
  for setting, perturbations in SETTINGS.items():
    for policy_name in POLICIES:
      completion, numeric, name, result = simulate(
          policy_name, perturbations, scheds, cluster, costs, iteration)
      key = (type(numeric), numeric.wave, numeric.clock_distance, name)
      if key not in pipes:
        pipes[key] = executor.Pipeline(
            staged.stage_fns, cross_entropy, scheds[name][0],
            optax.sgd(LEARNING_RATE), mesh, sync=numeric)
      losses, acc = train(pipes[key], numeric, staged, data, num_windows)
      ends = completion[WINDOW - 1::WINDOW]
      extra = ""
      if policy_name == "SDPipe":
        extra = (f"skipped validations {len(result.extras['sdpipe_skipped'])},"
                 f" sp.sync.SDPipe from ready times agrees on "
                 f"{sdpipe_agreement(result, numeric):.0%}")
      elif policy_name.startswith("WSP"):
        extra = f"mean wave delay {numeric.delays.mean():.2f}"
      runs[(setting, policy_name)] = dict(
          time=ends, loss=losses, acc=acc,
          staleness=float(result.staleness.mean() / PIPELINES), extra=extra)
  harness.record("sync_wallclock", _table(runs))
  png = harness.figure_path("sync_wallclock.png")
  if png:
    _plot(runs, png)
  print(f"\n{len(pipes)} compiled pipelines; {time.time() - started:.0f} s "
        "in all")


def _first_window_at_target(run) -> int | None:
  hit = np.flatnonzero(smooth(run["loss"]) <= TARGET_LOSS)
  return int(hit[0]) if hit.size else None


def _time_to_target(run) -> float:
  k = _first_window_at_target(run)
  return float("nan") if k is None else float(run["time"][k])


def _table(runs) -> list[dict]:
  """Prints the markdown table and returns its rows."""
  rows = []
  print(f"\n| setting | policy | simulated time, all minibatches (s) "
        f"| minibatches to loss <= {TARGET_LOSS} | time to it (s) | vs BSP | "
        "final loss | test accuracy | observed staleness / N | trace |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for setting in SETTINGS:
    bsp = _time_to_target(runs[(setting, "BSP")])
    for policy_name in POLICIES:
      run = runs[(setting, policy_name)]
      hit = _time_to_target(run)
      k = _first_window_at_target(run)
      steps = "-" if k is None else (k + 1) * WINDOW
      print(f"| {setting} | {policy_name} | {run['time'][-1]:.1f} | "
            f"{steps} | {hit:.1f} | {bsp / hit:.2f}x | "
            f"{smooth(run['loss'])[-1]:.3f} | {run['acc']:.3f} | "
            f"{run['staleness']:.2f} | {run['extra']} |")
      rows.append({"setting": setting, "policy": policy_name,
                   "time_all": float(run["time"][-1]),
                   "minibatches_to_target": None if k is None else steps,
                   "time_to_target": hit, "speedup_vs_bsp": bsp / hit,
                   "final_loss": float(smooth(run["loss"])[-1]),
                   "test_accuracy": run["acc"],
                   "staleness_per_n": run["staleness"]})
  return rows


_STYLE = {"BSP": dict(color="C0", lw=2.5), "WSP D=0": dict(color="C1"),
          "WSP D=4": dict(color="C2", ls="--"),
          "WSP D=32": dict(color="C3", ls=":"),
          "SDPipe": dict(color="C4", lw=1.5), "AD-PSGD": dict(color="C5")}


def _plot(runs, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(SETTINGS), figsize=(15, 4.2), sharey=True)
  for ax, setting in zip(axes, SETTINGS):
    for policy_name in POLICIES:
      run = runs[(setting, policy_name)]
      ax.plot(run["time"], smooth(run["loss"]), label=policy_name,
              **_STYLE[policy_name])
    ax.axhline(TARGET_LOSS, color="gray", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_title(f"{setting}: {PIPELINES} pipelines x {STAGES} stages")
    ax.set_xlabel("simulated wall-clock (s)")
  axes[0].set_ylabel(f"training loss (mean of {SMOOTH} windows)")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  harness.run(main)
