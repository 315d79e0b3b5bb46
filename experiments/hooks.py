"""Hooks an experiment adds to a run, written outside `stalepipe/`.

A hook is a callable with `every` (in steps) that the training loop calls
with the run state after each window that reaches a multiple of `every`
(`stalepipe.train.loop`). A config names it by import path; the trainer
calls `factory(parts, workdir, **kwargs)` once, before the first window:

  python launch.py --config=configs/pipedream.py \
      --config.hooks="(('experiments.hooks:StageNorms', {'every': 40}),)"

or from Python, `trainer.train_and_evaluate(config, workdir,
hooks=[StageNorms(parts, workdir, every=40)])`.
"""

import json
import os

import jax
import numpy as np


class StageNorms:
  """Writes each stage's weight norm, :math:`\\|x_s\\|_2`, every `every` steps
  to `<workdir>/stage_norms.jsonl` as `{"step": t, "norms": [n_0, ...]}`.

  The weights are the newest version on each stage (`Pipeline.params`), as
  the final `params.npz` holds them at the last step.
  """

  def __init__(self, parts, workdir: str, every: int = 100):
    self.every = every
    self._params = parts.pipeline.params
    self._path = os.path.join(workdir, "stage_norms.jsonl")

  def __call__(self, run) -> None:
    norms = [float(np.sqrt(sum(np.sum(np.square(np.asarray(leaf, np.float64)))
                               for leaf in jax.tree.leaves(stage))))
             for stage in self._params(run.state)]
    if jax.process_index() == 0:
      with open(self._path, "a") as f:
        f.write(json.dumps({"step": run.step, "norms": norms}) + "\n")
