"""Hooks an experiment adds to a run, written outside `stalepipe/`.

A hook is a callable with `every` (in steps) that the training loop calls
with the run state after each window that reaches a multiple of `every`
(`stalepipe.train.loop`). A config names it by import path; the trainer
calls `factory(parts, workdir, **kwargs)` once, before the first window:

  python launch.py --config=configs/pipedream.py \
      --config.hooks="(('experiments.hooks:StageNorms', {'every': 40}),)"

or from Python, `trainer.train_and_evaluate(config, workdir,
hooks=[StageNorms(parts, workdir, every=40)])`.

A hook that records a figure the run's `summary.json` lacks writes it to
`<workdir>/figures.json`, which `experiments/summarize.py` reads beside it.
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


class LearnsItsData:
  """Writes the figures that show a model learns its data to `figures.json`.

  `first_loss` and `last_loss` are the mean training loss of the first
  `first` and the last `last` steps; `num_params` counts the model's
  weights; the references an untrained model sits at are the majority
  class's test accuracy (`majority_accuracy`) and, for a language model,
  the unigram entropy of the training labels in bits (`unigram_bits`).
  Losses are read every window (`every` = minibatches per window).
  """

  def __init__(self, parts, workdir: str, first: int = 10, last: int = 20):
    self.every = parts.steps_per_window
    self._first, self._last = first, last
    self._path = os.path.join(workdir, "figures.json")
    self._losses = []  # each window's mean training loss
    y_test = parts.test[1]
    y_train = np.concatenate([shard.y for shard in parts.shards])
    self._figures = {
        "num_params": sum(int(np.size(x)) for x in jax.tree.leaves(
            parts.staged.stage_params)),
        "majority_accuracy": float(np.bincount(y_test.ravel()).max()
                                   / y_test.size)}
    if y_train.ndim > 1:  # next-token labels
      p = np.bincount(y_train.ravel()) / y_train.size
      p = p[p > 0]
      self._figures["unigram_bits"] = float(-(p * np.log2(p)).sum())

  def __call__(self, run) -> None:
    self._losses.append(float(run.metrics["loss"]))

  def end(self, run) -> None:
    del run
    first = -(-self._first // self.every)  # windows, rounded up
    last = -(-self._last // self.every)
    figures = dict(self._figures,
                   first_loss=float(np.mean(self._losses[:first])),
                   last_loss=float(np.mean(self._losses[-last:])))
    if jax.process_index() == 0:
      with open(self._path, "w") as f:
        json.dump(figures, f, indent=2)
