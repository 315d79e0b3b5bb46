"""The optimizer of a config: parts named from registries, after big_vision's `optax.py`.

A config names its update rule as pure data:

.. code-block:: python

  config.transforms = (("stale_gradients", {"delay": 1}),
                       ("delay_compensation", {"lam": 0.2}))
  config.optimizer = "sgd"
  config.optimizer_kwargs = {"learning_rate": 0.1, "momentum": 0.9}
  config.lr_schedule = ("warmup_cosine_decay_schedule",
                        {"init_value": 0.0, "peak_value": 0.1,
                         "warmup_steps": 50, "decay_steps": 800})
  config.weight_decay, config.weight_decay_mode = 1e-4, "l2"
  config.grad_clip_norm = 1.0
  config.optimizer_wrapper = ()  # or ("WeightPrediction", {"option": 3})

gives, in this order,

.. code-block:: python

  optax.chain(optax.clip_by_global_norm(1.0),      # the raw gradient
              stale_gradients(1), delay_compensation(0.2),
              optax.add_decayed_weights(1e-4),     # "l2": SGD's weight_decay
              optax.sgd(schedule, momentum=0.9))   # "decoupled" adds -lr_t wd x after it

"l2" decay goes before the first transform that turns a gradient into a
direction (`optim.DIRECTIONS`: `scale_by_async_nesterov`,
`scale_by_basis_rotation`, ...), as it joins the gradient inside the
optimizer in the rules' sources.
A transform that keeps the optimizer's own statistics (`optim.MIRRORS`:
`gap_aware`) gets the optimizer's form (`sgd`, or `adam`/`adamw`),
learning rate (the schedule, with `lr_schedule`) and moment settings
(`momentum`; `b1`, `b2`, `eps`), and a config that gives it different ones
is refused.

Each name is looked up in one registry (`stalepipe.registry.Registry`):
transforms in `stalepipe.optim.TRANSFORMS`, wrappers in
`stalepipe.optim.WRAPPERS` (the chained optimizer is passed as their
`optimizer`: `WeightPrediction(chain, option=3)`), learning-rate schedules in
`SCHEDULES` (those of `optax.schedules`) and optimizers in `OPTIMIZERS`
(optax's factories that take a learning rate). A transform or wrapper that
takes `num_workers` gets `num_replicas` unless the config sets it.
"""

import inspect
from typing import Any, Callable, NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import optax

from stalepipe import optim
from stalepipe import registry

WEIGHT_DECAY_MODES = ("l2", "decoupled")


# optax's factories a config cannot use: L-BFGS's update needs the loss and
# its function (`value`, `grad`, `value_fn`), which a pipeline's stages never
# see whole; joining schedules takes schedule objects, not data.
_NOT_FROM_A_CONFIG = ("lbfgs", "join_schedules")


def _optax_optimizers() -> dict[str, Callable[..., Any]]:
  """optax's optimizers: its public factories that take a learning rate."""
  found = {}
  for name in dir(optax):
    factory = getattr(optax, name)
    if (name.startswith(("_", "scale_by")) or name in _NOT_FROM_A_CONFIG
        or not inspect.isfunction(factory)):
      continue
    try:
      if "learning_rate" in inspect.signature(factory).parameters:
        found[name] = factory
    except (TypeError, ValueError):
      continue
  return dict(sorted(found.items()))


def muon(learning_rate: optax.ScalarOrSchedule, *, mask: Any = None,
         **kwargs: Any) -> optax.GradientTransformation:
  r"""`optax.contrib.muon`, its Newton-Schulz leaves chosen by a named mask.

  On each selected matrix Muon orthogonalises a Nesterov momentum:

  .. math::
    m_t = \beta m_{t-1} + (1-\beta) g_t, \quad
    M = \beta \frac{m_t}{1-\beta^{t+1}} + (1-\beta) \frac{g_t}{1-\beta^t},
    \quad u = -\eta \sqrt{\max(1, n_{out}/n_{in})}\ \mathrm{NS}_5(M)

  with :math:`\mathrm{NS}_5` five quintic Newton-Schulz steps
  :math:`X \leftarrow aX + (bA + cA^2)X`, :math:`A = XX^\top`,
  :math:`(a, b, c) = (3.4445, -4.7750, 2.0315)`, from
  :math:`X = M / (\lVert M\rVert_F + \epsilon)` (on :math:`M^\top` when it
  has more rows than columns). Every other leaf gets AdamW, as the Muon
  recipe gives embeddings, head, norms and biases to Adam.

  Args:
    learning_rate: :math:`\eta`, a number or an optax schedule.
    mask: which leaves get Newton-Schulz: a name from `optim.MASKS`
      (`"attention_mlp"`, `"all_matrices"`), a pytree of bools like the
      params, or a callable returning one; None is optax's default (every
      2-D leaf). Each selected leaf must be 2-D.
    **kwargs: the other keyword arguments of `optax.contrib.muon` (`beta`,
      `ns_steps`, `nesterov`, `weight_decay`, `adam_b1`, ...), except
      `muon_weight_dimension_numbers`, which `mask` sets.

  Returns:
    `optax.contrib.muon(learning_rate, muon_weight_dimension_numbers=...,
    **kwargs)`.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"fc": {"kernel": jnp.ones((3, 4))},
    ...           "head": {"kernel": jnp.ones((4, 2))}}
    >>> opt = muon(0.02, mask="attention_mlp")
    >>> updates, _ = opt.update(params, opt.init(params), params)
    >>> # the head is Adam's, Nesterov too: -lr (1 + b1 (1 - b1) / (1 - b1^2))
    >>> round(float(updates["head"]["kernel"][0, 0]), 4)
    -0.0295

  References:
    Jordan et al, `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024; optax 0.2.8
    `optax/contrib/_muon.py` (`muon`, lines 519-727; the coefficients, line
    42; Nesterov momentum, lines 486-497; the iteration, lines 239-250).
  """
  taken = inspect.signature(optax.contrib.muon).parameters
  for key in kwargs:
    if key not in taken or key in ("learning_rate",
                                   "muon_weight_dimension_numbers"):
      raise ValueError(f"muon takes no {key!r} here; valid: mask, "
                       + ", ".join(k for k in taken if k not in (
                           "muon_weight_dimension_numbers",)))
  dims = None
  if mask is not None:
    select = optim.mask(mask)

    def dims(params):
      chosen = select(params) if callable(select) else select
      return jax.tree.map(
          lambda c: optax.contrib.MuonDimensionNumbers() if c else None,
          chosen)
  return optax.contrib.muon(learning_rate, muon_weight_dimension_numbers=dims,
                            **kwargs)


# optax's top-level optimizers, and Muon from optax.contrib with a named mask.
OPTIMIZERS = registry.Registry("optimizer", {**_optax_optimizers(),
                                             "muon": muon})
SCHEDULES = registry.Registry("schedule", {
    name: obj for name, obj in vars(optax.schedules).items()
    if not name.startswith("_") and name not in _NOT_FROM_A_CONFIG
    and inspect.isfunction(obj)
    and inspect.signature(obj).return_annotation == optax.Schedule})


def _entry(entry: Any, what: str) -> tuple[str, dict[str, Any]]:
  """A `(name, kwargs)` pair."""
  if isinstance(entry, str) or len(entry) != 2:
    raise ValueError(f"{what} {entry!r} is invalid; valid: a (name, kwargs) "
                     "pair")
  name, kwargs = entry
  return name, dict(kwargs)


def _with_workers(registry_: registry.Registry, name: str,
                  kwargs: dict[str, Any], num_replicas: int) -> dict[str, Any]:
  if "num_workers" in registry_.keys(name):
    kwargs.setdefault("num_workers", num_replicas)
  return kwargs


# What a transform of `optim.MIRRORS` mirrors: the optimizer's form, and the
# settings it shares with the optimizer.
_MIRRORED_FORMS = {"sgd": "sgd", "adam": "adam", "adamw": "adam"}
_MIRRORED_KEYS = ("learning_rate", "b1", "b2", "eps", "momentum")


def _mirrored(name: str, kwargs: dict[str, Any], optimizer: str,
              optimizer_kwargs: dict[str, Any]) -> dict[str, Any]:
  """`kwargs` of a transform that mirrors the optimizer's statistics
  (`optim.MIRRORS`, Gap-Aware), with the optimizer's form and settings.

  Raises:
    ValueError: in one line, for an optimizer it cannot mirror, or a setting
      the config gives the transform that differs from the optimizer's.
  """
  plain = {"nesterov": False, "eps_root": 0.0}
  if optimizer not in _MIRRORED_FORMS or (
      optimizer != "sgd" and any(optimizer_kwargs.get(k, v) != v
                                 for k, v in plain.items())):
    raise ValueError(f"transform {name!r} with optimizer {optimizer!r} "
                     f"{optimizer_kwargs} is invalid; valid: optimizer sgd, "
                     "or adam/adamw without nesterov or eps_root")
  taken = optim.TRANSFORMS.keys(name)
  params = inspect.signature(OPTIMIZERS.factory(optimizer)).parameters
  wanted = {"form": _MIRRORED_FORMS[optimizer]} if "form" in taken else {}
  for key in _MIRRORED_KEYS:
    if key not in taken or key not in params:
      continue
    value = optimizer_kwargs.get(key, params[key].default)
    if value is inspect.Parameter.empty:
      continue
    wanted[key] = 0.0 if key == "momentum" and value is None else value
  for key, value in wanted.items():
    if key in kwargs and kwargs[key] is not value and kwargs[key] != value:
      raise ValueError(f"transform {name!r} {key}={kwargs[key]!r} is "
                       f"invalid with optimizer {optimizer!r}; valid: its "
                       f"{key}, {value!r} (or leave it out)")
  return {**kwargs, **wanted}


def make_schedule(entry: tuple[str, dict[str, Any]]) -> optax.Schedule:
  """An optax schedule from `(name, kwargs)`, e.g. warm-up plus cosine.

  Examples:
    >>> sched = make_schedule(("piecewise_constant_schedule",
    ...                        {"init_value": 0.1,
    ...                         "boundaries_and_scales": {100: 0.1}}))
    >>> [round(float(sched(t)), 4) for t in (0, 99, 100)]  # step decay
    [0.1, 0.1, 0.01]
  """
  name, kwargs = _entry(entry, "schedule")
  # Config dicts key by strings; step decay's boundaries are steps.
  if "boundaries_and_scales" in kwargs:
    kwargs["boundaries_and_scales"] = {
        int(k): v for k, v in dict(kwargs["boundaries_and_scales"]).items()}
  return SCHEDULES.make(name, **kwargs)


class DecoupledWeightDecayState(NamedTuple):
  """State of `decoupled_weight_decay`."""

  count: chex.Array  # [] int32, calls so far (saturating): the schedule's step.


def decoupled_weight_decay(
    weight_decay: float, learning_rate: optax.ScalarOrSchedule
) -> optax.GradientTransformation:
  r"""Adds the decoupled (AdamW) weight decay to finished updates.

  .. math::
    u \leftarrow u - \eta_t\, \lambda\, x

  placed after an optimizer whose updates already carry :math:`-\eta_t`; with
  `optax.adam(lr)` before it this is `optax.adamw(lr, weight_decay=wd)`.

  Args:
    weight_decay: :math:`\lambda`.
    learning_rate: :math:`\eta_t`, a number or an optax schedule.

  Returns:
    An `optax.GradientTransformation`; its update needs `params`.

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """

  def init_fn(params):
    del params
    return DecoupledWeightDecayState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("decoupled weight decay needs params=; valid: the "
                       "params the update will be applied to")
    lr = learning_rate(state.count) if callable(learning_rate) else (
        learning_rate)
    updates = jax.tree.map(
        lambda u, x: (u - lr * weight_decay * x).astype(u.dtype), updates,
        params)
    return updates, DecoupledWeightDecayState(optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def make(
    transforms: Sequence[tuple[str, dict[str, Any]]],
    optimizer: str,
    optimizer_kwargs: dict[str, Any],
    num_replicas: int = 1,
    *,
    lr_schedule: Sequence[Any] = (),
    weight_decay: float = 0.0,
    weight_decay_mode: str = "l2",
    grad_clip_norm: float = 0.0,
    wrapper: Sequence[Any] = (),
) -> Any:
  """Chains the named `stalepipe.optim` transforms before `optax.<optimizer>`.

  Args:
    transforms: `(name, kwargs)` pairs, names from `optim.TRANSFORMS`.
    optimizer: an optax alias such as `sgd`, `adam`, `adamw`.
    optimizer_kwargs: its keyword arguments.
    num_replicas: the data replicas; the default `num_workers` of transforms
      and wrappers that take one (SDPipe's N, SAPipe's n).
    lr_schedule: `(name, kwargs)` of an optax schedule (`SCHEDULES`) that
      replaces `optimizer_kwargs["learning_rate"]`; `()` keeps it.
    weight_decay: :math:`\\lambda`; 0 adds nothing.
    weight_decay_mode: `"l2"` adds :math:`\\lambda x` to the gradient the
      first scale-by rule (`optim.DIRECTIONS`) or else the optimizer gets
      (SGD's `weight_decay`, DC-ASGD's and SAPipe's runs);
      `"decoupled"` adds :math:`-\\eta_t \\lambda x` to its update (AdamW).
    grad_clip_norm: clip the raw gradient, before every transform, to this
      global norm; 0 does not clip.
    wrapper: `(name, kwargs)` of a wrapper from `optim.WRAPPERS`, given the whole
      chain as its `optimizer`; `()` for none.

  Returns:
    The optimizer: an optax transform, or the wrapper object (which keeps
    its `predict`, if it has one).

  Examples:
    >>> import jax.numpy as jnp
    >>> opt = make((("stale_gradients", {"delay": 1}),), "sgd",
    ...            {"learning_rate": 0.1})
    >>> x = jnp.ones(2)
    >>> state = opt.init(x)
    >>> u0, state = opt.update(x, state, x)
    >>> u1, state = opt.update(2 * x, state, x)
    >>> [round(float(v), 4) for v in (u0[0], u1[0])]
    [-0.0, -0.1]
  """
  OPTIMIZERS.factory(optimizer)
  if weight_decay_mode not in WEIGHT_DECAY_MODES:
    raise ValueError(f"weight_decay_mode={weight_decay_mode!r} is invalid; "
                     f"valid: {WEIGHT_DECAY_MODES}")
  if weight_decay < 0 or grad_clip_norm < 0:
    raise ValueError(f"weight_decay={weight_decay}, grad_clip_norm="
                     f"{grad_clip_norm} is invalid; valid: both >= 0")
  optimizer_kwargs = dict(optimizer_kwargs)
  if lr_schedule:
    optimizer_kwargs["learning_rate"] = make_schedule(lr_schedule)
  # The clip sees the raw gradient, as every rule's source clips it
  # (`torch.nn.utils.clip_grad_norm_` before `optimizer.step()`); L2 decay
  # joins the gradient where it becomes a direction: before the first
  # scale-by rule, else before the optimizer.
  chain = [optax.clip_by_global_norm(grad_clip_norm)] if grad_clip_norm else []
  l2 = [optax.add_decayed_weights(weight_decay)] if (
      weight_decay and weight_decay_mode == "l2") else []
  for entry in transforms:
    name, kwargs = _entry(entry, "transform")
    if name in optim.DIRECTIONS:
      chain, l2 = chain + l2, []
    if name in optim.MIRRORS:
      kwargs = _mirrored(name, kwargs, optimizer, optimizer_kwargs)
    chain.append(optim.TRANSFORMS.make(
        name, **_with_workers(optim.TRANSFORMS, name, kwargs, num_replicas)))
  chain += l2
  chain.append(OPTIMIZERS.make(optimizer, **optimizer_kwargs))
  if weight_decay and weight_decay_mode == "decoupled":
    if "learning_rate" not in optimizer_kwargs:
      raise ValueError(f"weight_decay_mode='decoupled' with optimizer_kwargs "
                       f"{sorted(optimizer_kwargs)} is invalid; valid: "
                       "optimizer_kwargs with learning_rate, or lr_schedule")
    chain.append(decoupled_weight_decay(weight_decay,
                                        optimizer_kwargs["learning_rate"]))
  tx = optax.chain(*chain) if len(chain) > 1 else chain[0]
  if not wrapper:
    return tx
  name, kwargs = _entry(wrapper, "optimizer wrapper")
  return optim.WRAPPERS.make(
      name, tx, **_with_workers(optim.WRAPPERS, name, kwargs, num_replicas))


def from_config(config: Any, num_replicas: int) -> Any:
  """`make` with every optimizer field of a config (defaults where absent)."""
  return make(config.transforms, config.optimizer, config.optimizer_kwargs,
              num_replicas=num_replicas,
              lr_schedule=config.get("lr_schedule", ()),
              weight_decay=config.get("weight_decay", 0.0),
              weight_decay_mode=config.get("weight_decay_mode", "l2"),
              grad_clip_norm=config.get("grad_clip_norm", 0.0),
              wrapper=config.get("optimizer_wrapper", ()))
