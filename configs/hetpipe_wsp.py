r"""HetPipe: N_m concurrent minibatches per virtual worker, WSP across workers.

Run:
  python launch.py --config=configs/hetpipe_wsp.py --workdir=runs/hetpipe_wsp
Model/data variants as in configs/default.py, e.g.
`configs/hetpipe_wsp.py:variant=vgg_digits`.

References:
  Park et al, HetPipe <https://arxiv.org/abs/2005.14038>, USENIX ATC 2020 (§4
  pipelining with N_m, §5 WSP with clock distance D); seed 000 (WSP).
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.schedule = "hetpipe"
  config.schedule_kwargs = ml_collections.ConfigDict(
      {"concurrent_minibatches": 4})
  config.num_microbatches = 1  # HetPipe pipelines whole minibatches
  config.microbatch_size = 32
  config.sync = "wsp"
  config.sync_kwargs = ml_collections.ConfigDict({"clock_distance": 0})
  return config
