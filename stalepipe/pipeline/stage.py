r"""A stage function as a researcher writes it, and what the executors call.

A stage is `f(params, x) -> y`, with `x` and `y` pytrees of arrays. It may
also declare keyword arguments the executors then pass:

- `key`: a PRNG key (`jax.random.key`) for this (minibatch, micro-batch,
  stage, data replica), derived from the pipeline's `seed`:

  .. math:: k = \mathrm{fold}(\mathrm{fold}(\mathrm{fold}(\mathrm{fold}(
     \mathrm{key}(seed), p), m), s), d)

  so the oracle and the executor, a recomputed forward and a residual
  backward, and a resumed run all see the same randomness (dropout masks);
- `train`: True in a training step, False in `evaluate`;
- `state`: the stage's non-parameter state (a pytree: BatchNorm's running
  statistics, counters), as its forwards so far left it.

It may return `Output(value, loss, metrics, state)` instead of `value`:

- `loss`: an auxiliary loss of the stage (an MoE load-balancing term; a
  scalar, the mean over the micro-batch), added to the objective of its
  micro-batch,

  .. math:: L = \ell(f(x), t) + \sum_s a_s,

  with its gradients (through the stage's weights and, by its input, the
  stages before it). The executors carry the running sum of the stages'
  terms beside each boundary's value, so it reaches the last stage's
  objective like any other activation and its cotangent flows back the same
  way;
- `metrics`: a dict of float scalars for the micro-batch (token counts, an
  expert's load), carried to the last stage the same way but with no
  gradient; `step` returns each as its mean over the micro-batches whose
  loss the window took. Names are unique across stages and the loss
  function, which may return `(loss, metrics)` (accuracy);
- `state`: the stage's new state, for stages that take `state`. Only a
  training forward (F, or a task that runs the forward) updates it, once
  per micro-batch in the order the stage runs them; a recomputed forward
  and `evaluate` read it and leave it. A training forward's value may not
  read the state (BatchNorm normalises with the batch's own statistics in
  training): the backward would otherwise see a newer state than its
  forward did. `Pipeline` refuses such a stage in one line.

Examples:
  >>> import jax
  >>> def stage(params, x, *, key, train):
  ...   keep = jax.random.bernoulli(key, 0.9, x.shape) if train else 1.0
  ...   return (x @ params["w"]) * keep / 0.9
  >>> sorted(wants(stage))
  ['key', 'train']

Inside the executors a stage that wants a key or a state takes them as part
of its input, `(x, {"key": key_data, "state": state})` (`bind`), so every
analysis of a stage (residuals, the split backward) sees them as inputs,
never as constants.
"""

import inspect
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from stalepipe.pipeline import split_backward

ARGUMENTS = ("key", "train", "state")
EXTRAS = ("key", "state")  # what enters a bound stage as part of its input
STEP_METRICS = ("loss", "num_losses", "seconds", "examples_per_s",
                "tokens_per_s", "staleness")  # names `step` already returns
# What the trainer adds to a `metrics.jsonl` record beside the step's metrics
# (`train/hooks.py`: `Log`, `Evaluate`; `train/trainer.py`: `extra`). `Log`
# refuses to write a name missing here, so this list cannot drift.
RECORD_NAMES = ("step", "test_loss", "test_accuracy", "bubble",
                "staleness_mean", "staleness_max", "steps_per_s",
                "state_bytes", "host_peak_bytes", "device_peak_bytes")
RESERVED = STEP_METRICS + RECORD_NAMES  # no stage or loss metric takes one


def wants(fn: Callable) -> frozenset[str]:
  """The keyword arguments of `ARGUMENTS` that `fn` declares."""
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return frozenset()
  return frozenset(a for a in ARGUMENTS if a in parameters)


class Output(NamedTuple):
  """What a stage may return: its value, an auxiliary loss, metrics and its
  new state."""

  value: Any  # the stage's output, the next stage's input
  loss: Any = 0.0  # scalar: the stage's auxiliary loss for the micro-batch
  metrics: Any = None  # dict name -> float scalar for the micro-batch
  state: Any = None  # the stage's new state (stages that take `state`)


def _merge_metrics(carried: dict, own, where: str) -> dict:
  """`carried` with `own` added: float32 scalars, without gradient."""
  merged = dict(carried)
  for name, value in dict(own or {}).items():
    value = jnp.asarray(value)
    if value.shape:
      raise ValueError(f"metric {name!r} of {where} has shape {value.shape}; "
                       "valid: a scalar per micro-batch")
    if name in merged or name in RESERVED:
      raise ValueError(f"metric {name!r} of {where} is reported twice or is "
                       f"reserved ({', '.join(RESERVED)}); valid: names unique "
                       "across stages and the loss")
    merged[name] = jax.lax.stop_gradient(value.astype(jnp.float32))
  return merged


def _call(fn: Callable, train: bool, first: bool, where: str) -> Callable:
  """`fn` on a bound input: `(params, x) -> (y, (a, metrics), new_state)`."""
  asked = wants(fn)
  extras = asked & set(EXTRAS)

  def call(p, xb):
    x, given = xb if extras else (xb, {})
    value, (carried, metrics) = (x, (0.0, {})) if first else x
    kwargs = {"train": train} if "train" in asked else {}
    if "key" in asked:
      kwargs["key"] = jax.random.wrap_key_data(given["key"])
    if "state" in asked:
      kwargs["state"] = given["state"]
    out = fn(p, value, **kwargs)
    if not isinstance(out, Output):
      out = Output(out)
    if out.state is not None and "state" not in asked:
      raise ValueError(f"{where} returns a state but takes none; valid: "
                       "declare a `state` keyword argument")
    if train and "state" in asked and out.state is None:
      raise ValueError(f"{where} takes a state but returned none in training; "
                       "valid: return Output(value, state=new_state)")
    aux = jnp.asarray(carried, jnp.float32) + jnp.asarray(out.loss,
                                                          jnp.float32)
    return (out.value, (aux, _merge_metrics(metrics, out.metrics, where)),
            out.state)

  return call


def bind(fn: Callable, train: bool, first: bool, where: str = "a stage"
         ) -> Callable:
  """`fn` as the executors call it: `(params, x) -> (y, (a, metrics))`, or,
  where `fn` wants a key or a state, `(params, (x, extras)) -> ...`; `a` is
  the float32 sum of the auxiliary losses of this stage and the ones before
  it and `metrics` theirs (no gradient), which every stage after the first
  takes beside its input: `x = (value, (a, metrics))`."""
  call = _call(fn, train, first, where)
  return lambda p, xb: call(p, xb)[:2]


def bind_state(fn: Callable, first: bool, where: str = "a stage") -> Callable:
  """The new state of a training forward of `fn` on a bound input:
  `(params, x) -> state`, without gradient."""
  call = _call(fn, True, first, where)
  return lambda p, xb: jax.lax.stop_gradient(call(p, xb)[2])


def bind_loss(loss_fn: Callable) -> Callable:
  """The objective of a micro-batch from the last bound stage's output:
  `(loss_fn(y, target) + a, metrics)`, `a` the stages' auxiliary losses and
  `metrics` theirs with the loss function's (it may return `(loss,
  metrics)`)."""
  def objective(out, target):
    y, (aux, metrics) = out
    value = loss_fn(y, target)
    own = None
    if isinstance(value, tuple):
      value, own = value
    if jnp.shape(value):
      raise ValueError(f"the loss function returned shape {jnp.shape(value)}; "
                       "valid: a scalar, the mean over the micro-batch (e.g. "
                       "`.mean()`)")
    return value + aux, _merge_metrics(metrics, own, "the loss function")

  return objective


def evaluation_objective(loss_fn: Callable, out, target):
  """What `evaluate` reports for a micro-batch: the loss of the last bound
  stage's output without auxiliary terms, and the stages' and the loss
  function's metrics, `(loss, metrics)`."""
  y, (_, metrics) = out
  return bind_loss(loss_fn)((y, (0.0, metrics)), target)


def takes_extras(asked: frozenset) -> bool:
  """Whether a stage asking `asked` takes `(x, extras)` when bound."""
  return bool(asked & set(EXTRAS))


def key_data(seed: int, minibatch, microbatch, stage, replica) -> jax.Array:
  """The raw key (uint32 data) of one (minibatch, micro-batch, stage,
  replica): traceable, the same in every executor."""
  key = jax.random.key(seed)
  for i in (minibatch, microbatch, stage, replica):
    key = jax.random.fold_in(key, jnp.asarray(i, jnp.uint32))
  return jax.random.key_data(key)


def key_struct() -> jax.ShapeDtypeStruct:
  """The shape of `key_data`'s result."""
  shape = jax.eval_shape(lambda: key_data(0, 0, 0, 0, 0))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype)


def with_extras(x, asked: frozenset, seed: int, minibatch, microbatch, stage,
                replica, state=None):
  """The input a bound stage takes: `x`, or `(x, extras)` with its key
  (`key_data`) and its state where it asks for them."""
  extras = {}
  if "key" in asked:
    extras["key"] = key_data(seed, minibatch, microbatch, stage, replica)
  if "state" in asked:
    extras["state"] = state
  return (x, extras) if extras else x


def extras_struct(x, asked: frozenset, state=None):
  """`with_extras` on shapes (`jax.ShapeDtypeStruct`)."""
  extras = {}
  if "key" in asked:
    extras["key"] = key_struct()
  if "state" in asked:
    extras["state"] = state
  return (x, extras) if extras else x


def input_cotangent(g, asked: frozenset):
  """The cotangent of the stage's own input, from that of its bound input."""
  return g[0] if takes_extras(asked) and g is not None else g


def bind_all(stage_fns: Sequence[Callable]) -> tuple:
  """Every stage bound for training: `(fns, state_fns, wants)`, `state_fns`
  None for stages without state."""
  asked = tuple(wants(f) for f in stage_fns)
  fns = tuple(bind(f, True, s == 0, f"stage {s}")
              for s, f in enumerate(stage_fns))
  state_fns = tuple(bind_state(f, s == 0, f"stage {s}") if "state" in a
                    else None for s, (f, a) in enumerate(zip(stage_fns, asked)))
  return fns, state_fns, asked


def initial_states(asked: Sequence[frozenset],
                   stage_states: Sequence[Any] | None) -> tuple | None:
  """The S stages' initial states as the executors hold them (`{}` for a
  stage without), or None where no stage takes a state.

  Raises:
    ValueError: a stage that takes a state without one, or the converse.
  """
  takes = [s for s, a in enumerate(asked) if "state" in a]
  given = [None] * len(asked) if stage_states is None else list(stage_states)
  if len(given) != len(asked):
    raise ValueError(f"{len(given)} stage states do not fit {len(asked)} "
                     f"stages; valid: {len(asked)}, None for a stage without")
  have = [s for s, v in enumerate(given) if v is not None]
  if have != takes:
    raise ValueError(f"stage states given for stages {have}, but stages "
                     f"{takes} take a `state`; valid: init(stage_params, "
                     "stage_states) with a state exactly for those")
  if not takes:
    return None
  return tuple({} if v is None else v for v in given)


def given_states(asked: Sequence[frozenset], states: Sequence[Any]) -> tuple:
  """`initial_states`'s inverse: None for a stage without a state."""
  return tuple(v if "state" in a else None for a, v in zip(asked, states))


def check_state(fn: Callable, state_fn: Callable, params, bound_input,
                s: int) -> None:
  """Refuses a stateful stage the executors cannot run as written: its new
  state shaped unlike its state, or its training value reading the state
  (`check_state_unread`). Shapes suffice."""
  state = bound_input[1]["state"]
  new = jax.eval_shape(state_fn, params, bound_input)
  shape = lambda t: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
      lambda v: (jnp.shape(v), jnp.result_type(v)), t)
  if (jax.tree.structure(new) != jax.tree.structure(state)
      or shape(new) != shape(state)):
    raise ValueError(f"stage {s}'s new state {shape(new)} is not shaped like "
                     f"its state {shape(state)}; valid: the same structure, "
                     "shapes and dtypes")
  check_state_unread(fn, params, bound_input, s)


def check_state_unread(fn: Callable, params, bound_input, s: int) -> None:
  """Refuses a stage whose training value reads its state (`fn` bound with
  train=True; shapes suffice): a backward would see a newer state than its
  forward did.

  Raises:
    ValueError: naming the stage.
  """
  x, extras = bound_input
  jaxpr = jax.make_jaxpr(lambda p, x, e: fn(p, (x, e)))(params, x, extras)
  leaves = jax.tree.leaves((params, x))
  state_read = split_backward.read_inputs(jaxpr.jaxpr)[len(leaves):]
  flags = jax.tree.unflatten(jax.tree.structure(extras), state_read)
  if any(jax.tree.leaves(flags.get("state", []))):
    raise ValueError(f"stage {s}'s training forward reads its state; valid: a "
                     "value that depends on params and input alone in "
                     "training (BatchNorm's batch statistics), the state only "
                     "updated")
