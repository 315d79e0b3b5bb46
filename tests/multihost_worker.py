"""One process of a multi-process pipeline run (started by multihost_test.py).

Usage: python multihost_worker.py PORT NUM_PROCESSES PROCESS_ID OUT.npz SPEC
SPEC is JSON: {"schedule", "schedule_kwargs", "sync", "sync_kwargs"}. With
NUM_PROCESSES=1 it runs alone on 8 devices: the reference result.
"""

import json
import os
import sys

port, num_processes, process_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out, spec = sys.argv[4], json.loads(sys.argv[5])
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={8 // num_processes}")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top

if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id)

import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

import stalepipe as sp  # pylint: disable=g-import-not-at-top
from stalepipe.pipeline import executor  # pylint: disable=g-import-not-at-top
from stalepipe.models.losses import cross_entropy as classification_loss  # pylint: disable=g-import-not-at-top

D, S, M, B, b = 4, 2, 2, 2, 2
staged = sp.models.split(sp.models.mlp(8, 6, 1, 4, seed=0), S)
schedule = sp.schedules.make(spec["schedule"], num_stages=S, num_microbatches=M,
                             num_minibatches=B, **spec["schedule_kwargs"])
mesh = jax.make_mesh((D, S), ("data", "stage"))
policy = sp.sync.make(spec["sync"], num_replicas=D, **spec["sync_kwargs"])
pipe = executor.Pipeline(staged.stage_fns, classification_loss, schedule,
                         optax.sgd(0.3), mesh, sync=policy)
state = pipe.init(staged.stage_params)
rng = np.random.default_rng(0)
local = slice(process_id * D * b // num_processes,
              (process_id + 1) * D * b // num_processes)
for _ in range(4):
  x = rng.normal(size=(B, M, D * b, 8)).astype(np.float32)
  y = rng.integers(0, 4, size=(B, M, D * b)).astype(np.int32)
  state, metrics = pipe.step(state, x[:, :, local], y[:, :, local])
params = {f"r{r}": np.concatenate([np.ravel(l) for l in jax.tree.leaves(
    pipe.params(state, r))]) for r in range(D)}
if process_id == 0:
  np.savez(out, loss=float(metrics["loss"]), **params)
