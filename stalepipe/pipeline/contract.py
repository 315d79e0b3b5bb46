"""The update-rule contract inside a pipeline, shared by both executors.

At a stage's update of minibatch p the executors call

    optimizer.update(grads, opt_state, weights, stale_params=...,
                     staleness=..., local_updates=...)

passing the extra arguments when the optimizer takes them (an
`optax.GradientTransformationExtraArgs`, or an optimizer with `predict`):

- `stale_params`: the weights p's gradient was computed on (its first
  backward's version: `Schedule.gradient_version`), passed only where the
  schedule makes gradients stale (`schedule_is_stale`); with a synchronous
  schedule a transform that delays gradients itself (SAPipe's 1-step stale
  all-reduce) compensates from its own history;
- `staleness`: updates the stage applied between p's forward read and this
  update (`update_version - forward_version`, PipeMare's tau);
- `local_updates`: this replica's own gradient; `grads` is what the sync
  policy made of it (BSP: the replicas' mean).

When the optimizer has `predict(state, weights, *, ahead, since_forward)`,
every forward and backward reads its result instead of the stashed weights,
with `ahead = Schedule.ahead(task)` (updates until the minibatch's own
update: SpecTrain's s with staleness="minibatch") and `since_forward =
Schedule.since_forward(task)` (updates since the minibatch's forward read:
PipeMare's tau_fwd - tau_bkwd).
An optimizer whose `staleness` is "pipeline" (SpecTrain as its paper) also
gets `pipeline_ahead = Schedule.pipeline_ahead(task)`, SpecTrain's
pipeline-wide s, and is refused on a schedule that does not define it.
The state passed is the stage's current optimizer state.
"""

import optax


def predicts(optimizer) -> bool:
  """Whether tasks read `optimizer.predict(...)` instead of the stash."""
  return callable(getattr(optimizer, "predict", None))


def pipeline_wide(optimizer) -> bool:
  """Whether `predict` gets `pipeline_ahead` (SpecTrain's paper staleness)."""
  return predicts(optimizer) and getattr(optimizer, "staleness",
                                         None) == "pipeline"


def takes_extra_args(optimizer) -> bool:
  """Whether `update` gets `stale_params`, `staleness` and `local_updates`."""
  return (isinstance(optimizer, optax.GradientTransformationExtraArgs)
          or predicts(optimizer))


def schedule_is_stale(schedule) -> bool:
  """Whether some update applies a gradient computed on older weights."""
  stream = schedule.with_minibatches(4 * schedule.num_minibatches)
  return any(stream.update_version(s, p) != stream.gradient_version(s, p)
             for s, p in stream.update_ticks)


def extra_args(optimizer, stale_schedule: bool, stale_params, staleness,
               local_updates) -> dict:
  """The keyword arguments `optimizer.update` gets in a pipeline
  (`stale_schedule`: `schedule_is_stale` of its schedule)."""
  if not takes_extra_args(optimizer):
    return {}
  kwargs = dict(staleness=staleness, local_updates=local_updates)
  if stale_schedule:
    kwargs["stale_params"] = stale_params
  return kwargs


def check(stage_fns, schedule, optimizer, sync, num_replicas: int) -> None:
  """Refuses, in one line each, what the executors cannot run as asked."""
  if len(stage_fns) != schedule.num_stages:
    raise ValueError(f"{len(stage_fns)} stage functions do not fit a "
                     f"schedule of {schedule.num_stages} stages; valid: "
                     f"{schedule.num_stages}")
  if sync.num_replicas != num_replicas:
    raise ValueError(f"sync policy over {sync.num_replicas} replicas does not "
                     f"fit the {num_replicas} data replicas; valid: "
                     f"{num_replicas}")
  concurrent = schedule.options.get("concurrent_minibatches")
  if sync.wave and concurrent is not None and sync.wave != concurrent:
    raise ValueError(f"WSP waves of {sync.wave} minibatches do not fit the "
                     f"schedule's concurrent_minibatches={concurrent}; "
                     "valid: equal (a wave is N_m minibatches)")
  workers = getattr(optimizer, "num_workers", None)
  averaged = num_replicas if sync.average_gradients else 1
  if workers is not None and workers != averaged:
    raise ValueError(f"optimizer's num_workers={workers} does not fit the "
                     f"{averaged} replica(s) whose gradients the sync policy "
                     f"{sync.name!r} averages; valid: num_workers={averaged}")
  if not callable(getattr(optimizer, "update", None)) or not callable(
      getattr(optimizer, "init", None)):
    raise ValueError(f"optimizer {optimizer!r} is invalid; valid: an optax "
                     "transformation (init and update)")
  if pipeline_wide(optimizer) and schedule.pipeline_ahead_error:
    raise ValueError(schedule.pipeline_ahead_error)


def refuse_drained(drained: bool) -> None:
  """Refuses to go on from a drained state (both executors): its in-flight
  work is finished, so a further window would train as no schedule does."""
  if drained:
    raise ValueError(
        "the state was drained (drain() finished the minibatches in flight) "
        "and takes no further step or drain; valid: drain once, at the end of "
        "training (evaluate and params read an undrained state's latest "
        "weights)")
