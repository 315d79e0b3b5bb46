r"""PipeMare: asynchronous 1F1B without weight stashing, rescheduled and corrected.

No stash (as `configs/spectrain.py`): forwards and backwards read their
stage's latest weights. PipeMare (T1) scales each stage's step by its delay
tau to the power -(1 - (t+1)/K) over the first K updates (t from 0, counted
from 1 as AsyncPP does), and (T2) gives the
backward the weights extrapolated back to its forward's,
`w - (tau_fwd - tau_bkwd) delta`, delta an EMA of the applied updates
(`stalepipe.optim.PipeMare`; docs/optim.md says which parts could be checked
against the paper).

Run:
  python launch.py --config=configs/pipemare.py --workdir=runs/pipemare
Model/data variants as in configs/default.py.

References:
  Yang et al, PipeMare: Asynchronous Pipeline Parallel DNN Training, MLSys
  2021.
"""

import ml_collections

from configs import default
from configs import spectrain


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = spectrain.get_config(arg)
  # PipeMare's delays hold for any M: the default's micro-batches.
  base = default.get_config(arg)
  config.num_microbatches = base.num_microbatches
  config.microbatch_size = base.microbatch_size
  config.optimizer_wrapper = ("PipeMare", {"warmup_steps": 100, "decay": 0.5})
  return config
