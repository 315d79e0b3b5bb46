r"""Sync policies against simulated wall-clock under stragglers (SDPipe §5.3).

4 x 2 stages, MLP on digits, SGD 0.1; each policy replays its run's simulation.
  mkdir -p runs/sync_wallclock
  for st in homogeneous hete-A hete-B; do for p in bsp wsp0 wsp4 wsp32 sdpipe ad_psgd; do
    python launch.py --config=configs/experiments/sync_wallclock.py:policy=$p,stragglers=$st \
        --workdir=runs/sync_wallclock/$st-$p-0 2> runs/sync_wallclock/$st-$p-0.err; done; done
  python experiments/summarize.py --runs='runs/sync_wallclock/*' --curve=simulated_seconds --smooth=4 \
      --keys=simulated_seconds_to_target,steps_to_target,simulated_seconds,replica_mean_test_accuracy \
      --out_dir=runs/sync_wallclock
"""

import ml_collections

from configs import common
from configs import default

POLICIES = {"bsp": {}, "sdpipe": {"history": 10}, "ad_psgd": {}, **{  # WSP:
    f"wsp{d}": {"clock_distance": d, "server": "mean"} for d in (0, 4, 32)}}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, policy="sdpipe", stragglers="hete-B", seed=0)
  if arg.policy not in POLICIES:
    raise ValueError(f"policy={arg.policy!r} is invalid; valid: {[*POLICIES]}")
  name = arg.policy.rstrip("0123456789")  # wsp4: WSP with D = 4
  config = default.get_config()
  config.update(
      seed=arg.seed, num_stages=2, num_replicas=4, num_microbatches=2,
      microbatch_size=8, minibatches_per_window=8, num_steps=256,
      schedule="hetpipe" if name == "wsp" else "1f1b", optimizer="sgd",
      log_every=8, eval_every=0, checkpoint_every=0, plots=False,
      model_kwargs={"hidden": 64, "num_hidden_layers": 1}, sync="simulated",
      schedule_kwargs={"concurrent_minibatches": 4} if name == "wsp" else {},
      optimizer_kwargs={"learning_rate": 0.1},
      sync_kwargs={"policy": name, "policy_kwargs": POLICIES[arg.policy],
                   "stragglers": arg.stragglers, "seed": arg.seed},
      hooks=(("experiments.hooks:SimulatedSeconds", {}),))
  return config
