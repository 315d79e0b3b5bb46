r"""BSP: pure data parallelism, 8 replicas all-reducing every gradient.

The synchronous baseline of the papers (Horovod / All-Reduce): the same mesh
as configs/pipesgd.py without its one-step-stale gradients.

Run:
  python launch.py --config=configs/bsp.py --workdir=runs/bsp
Model/data variants as in configs/default.py, e.g.
`configs/bsp.py:variant=vgg_digits`.

References:
  Valiant, A Bridging Model for Parallel Computation, CACM 1990; the BSP
  baseline of seed 001 (§8) and seed 002 (§6).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "gpipe"
  config.sync = "bsp"
  config.num_stages, config.num_replicas = 1, 8
  config.num_microbatches = 1
  return config
