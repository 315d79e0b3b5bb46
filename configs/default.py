r"""Default: an MLP on digits, GPipe over 4 stages x 2 data replicas.

Run:
  python launch.py --config=configs/default.py --workdir=runs/default
Override any field, e.g. `--config.num_microbatches=8`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Data and model.
  config.dataset = "digits"
  config.model = "mlp"
  config.model_kwargs = ml_collections.ConfigDict(
      {"hidden": 128, "num_hidden_layers": 3})
  # Pipeline: mesh ('data', 'stage') = (num_replicas, num_stages).
  config.schedule = "gpipe"
  config.schedule_kwargs = ml_collections.ConfigDict()
  config.num_stages = 4
  config.num_replicas = 2
  config.stage_boundaries = ()  # first block of each stage; () = even split
  config.num_microbatches = 4
  config.microbatch_size = 8  # examples per micro-batch per data replica
  config.minibatches_per_window = 4  # minibatches per jitted pipeline step
  # Optimization.
  config.optimizer = "adam"
  config.optimizer_kwargs = ml_collections.ConfigDict({"learning_rate": 1e-3})
  config.num_steps = 800  # minibatches
  config.log_every = 10  # windows
  return config
