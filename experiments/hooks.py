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

from stalepipe import models


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
  Losses are read every window (`every` = minibatches per window) and kept
  in `learns_its_data.jsonl`, so a resumed run's figures are those of the
  whole run: the windows up to its checkpoint are read back, later ones (run
  after that checkpoint, before the stop) dropped.
  """

  def __init__(self, parts, workdir: str, first: int = 10, last: int = 20):
    self.every = parts.steps_per_window
    self._first, self._last = first, last
    self._path = os.path.join(workdir, "figures.json")
    self._log = os.path.join(workdir, "learns_its_data.jsonl")
    self._losses = None  # {window's last step: its mean training loss}
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

  def _read_back(self, through: int) -> None:
    """The kept losses of the windows that end at step `through` or before."""
    self._losses = {}
    if os.path.exists(self._log):
      with open(self._log) as f:
        for record in map(json.loads, filter(str.strip, f)):
          if record["step"] <= through:
            self._losses[record["step"]] = record["loss"]

  def __call__(self, run) -> None:
    if self._losses is None:  # a resumed run starts a window after its step
      self._read_back(run.step - self.every)
    self._losses[run.step] = float(run.metrics["loss"])
    if jax.process_index() == 0:
      with open(self._log, "a") as f:
        f.write(json.dumps({"step": run.step,
                            "loss": self._losses[run.step]}) + "\n")

  def end(self, run) -> None:
    if self._losses is None:  # nothing left to train (a rerun after a stop)
      self._read_back(run.step)
    losses = [self._losses[s] for s in sorted(self._losses)]
    first = -(-self._first // self.every)  # windows, rounded up
    last = -(-self._last // self.every)
    figures = dict(self._figures,
                   first_loss=float(np.mean(losses[:first])),
                   last_loss=float(np.mean(losses[-last:])))
    if jax.process_index() == 0:
      with open(self._path, "w") as f:
        json.dump(figures, f, indent=2)


class SimulatedSeconds:
  """Puts a run's loss against the simulated wall-clock of its sync policy.

  For a run whose policy replays a simulation (`sync="simulated"`,
  `stalepipe.sync.simulated`), every logged step t (`log_every`) gets a
  record `{"step": t, "simulated_seconds": c_{t-1}}` in `metrics.jsonl`,
  :math:`c_p` the simulated time at which minibatch p's update is in place
  on every stage of every pipeline. At the end it writes to `figures.json`:
  `simulated_seconds` (all minibatches), `steps_to_target` and
  `simulated_seconds_to_target` (the first logged step whose training loss,
  the mean of the last `smooth` logged values, is at most `target`),
  `smoothed_final_loss`, the replicas' mean test accuracy
  (`replica_mean_test_accuracy`; the summary's is replica 0's) and the
  simulated `observed_staleness_per_replica`.
  """

  def __init__(self, parts, workdir: str, target: float = 0.15,
               smooth: int = 4):
    trace = parts.pipeline.sync.trace
    if trace is None:
      raise ValueError(f"hook SimulatedSeconds needs sync='simulated', not "
                       f"sync={parts.config.sync!r}; valid: a run whose sync "
                       "policy replays a simulation")
    self.every = parts.config.log_every
    self._seconds, self._staleness = trace.seconds, trace.staleness
    self._target, self._smooth = target, smooth
    self._workdir, self._parts = workdir, parts
    self._logged = None

  def _append(self, record: dict) -> None:
    if jax.process_index() == 0:
      with open(os.path.join(self._workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")

  def __call__(self, run) -> None:
    self._append({"step": run.step,
                  "simulated_seconds": float(self._seconds[run.step - 1])})
    self._logged = run.step

  def end(self, run) -> None:
    if run.metrics and self._logged != run.step:
      self(run)
    model_fn = models.unpipelined(self._parts.staged)
    x, y = self._parts.test
    accuracy = [float(np.mean(np.argmax(model_fn(
        self._parts.pipeline.params(run.state, r), x), -1) == y))
                for r in range(self._parts.config.num_replicas)]
    if jax.process_index() != 0:
      return
    with open(os.path.join(self._workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    steps = sorted(losses)
    smoothed = rolling_mean([losses[s] for s in steps], self._smooth)
    hit = next((s for s, v in zip(steps, smoothed) if v <= self._target),
               None)
    figures = {
        "simulated_seconds": float(self._seconds[run.step - 1]),
        "steps_to_target": hit,
        "simulated_seconds_to_target": (
            None if hit is None else float(self._seconds[hit - 1])),
        "smoothed_final_loss": float(smoothed[-1]) if steps else None,
        "replica_mean_test_accuracy": float(np.mean(accuracy)),
        "observed_staleness_per_replica": self._staleness}
    with open(os.path.join(self._workdir, "figures.json"), "w") as f:
      json.dump(figures, f, indent=2)


def rolling_mean(values, n: int) -> np.ndarray:
  """Mean of each value and the `n - 1` before it, the first value standing
  in for those before the start.

  Examples:
    >>> rolling_mean([4.0, 2.0, 0.0], 2)
    array([4., 3., 1.])
  """
  values = np.asarray(values, float)
  if not values.size:
    return values
  padded = np.concatenate([np.full(n - 1, values[0]), values])
  return np.convolve(padded, np.ones(n) / n, mode="valid")
