"""Parts built by name: one `Registry` behind every plane's `make` and `names`.

Every plane (schedules, sync policies, models, datasets, losses, update-rule
transforms and wrappers, optax optimizers and learning-rate schedules) keeps
its parts in a `Registry`, after big_vision's `registry.py`: the name is the
lookup, and `make` checks the keyword arguments against the factory's
signature before it calls it, so an unknown or missing argument is one line
naming it and what is valid. A factory checks its own values.

Examples:
  >>> def sgd_like(learning_rate: float, momentum: float = 0.0):
  ...   return (learning_rate, momentum)
  >>> parts = Registry("optimizer", {"sgd_like": sgd_like})
  >>> parts.names(), parts.keys("sgd_like")
  (('sgd_like',), ('learning_rate', 'momentum'))
  >>> parts.make("sgd_like", learning_rate=0.1)
  (0.1, 0.0)
  >>> parts.make("sgd_like", lr=0.1)
  Traceback (most recent call last):
  ...
  ValueError: optimizer 'sgd_like' takes no 'lr'; valid keys: learning_rate, momentum
"""

import inspect
from typing import Any, Callable, Iterable, Mapping


class Registry:
  """Named factories of one plane.

  Attributes:
    plane: what a part is, for messages ("schedule", "sync policy", ...).
    filled: keyword arguments the caller (the plane's `make`, the trainer)
      fills in itself; a config never names them.
  """

  def __init__(self, plane: str, parts: Mapping[str, Callable[..., Any]],
               filled: Iterable[str] = ()):
    self.plane = plane
    self.filled = frozenset(filled)
    self._parts = dict(parts)

  def names(self) -> tuple[str, ...]:
    """The names `make` accepts, in registration order."""
    return tuple(self._parts)

  def factory(self, name: str) -> Callable[..., Any]:
    """The factory registered under `name`; one line if there is none."""
    if name not in self._parts:
      raise ValueError(f"unknown {self.plane} {name!r}; valid: "
                       f"{', '.join(self.names())}")
    return self._parts[name]

  def _params(self, name: str) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(self.factory(name)).parameters

  def takes_any(self, name: str) -> bool:
    """Whether `name`'s factory takes any keyword (`**kwargs`)."""
    return any(p.kind == inspect.Parameter.VAR_KEYWORD
               for p in self._params(name).values())

  def keys(self, name: str) -> tuple[str, ...]:
    """The keyword arguments a config may give `name` (not the filled ones)."""
    return tuple(k for k, p in self._params(name).items()
                 if k not in self.filled and p.kind not in (
                     inspect.Parameter.VAR_POSITIONAL,
                     inspect.Parameter.VAR_KEYWORD))

  def required(self, name: str) -> tuple[str, ...]:
    """The keys of `keys(name)` that have no default."""
    params = self._params(name)
    return tuple(k for k in self.keys(name)
                 if params[k].default is inspect.Parameter.empty)

  def check(self, name: str, kwargs: Mapping[str, Any]) -> None:
    """One line (ValueError) for an unknown or a missing keyword argument."""
    keys = self.keys(name)
    if not self.takes_any(name):
      for key in kwargs:
        if key not in keys and key not in self.filled:
          raise ValueError(f"{self.plane} {name!r} takes no {key!r}; valid "
                           f"keys: {', '.join(keys) or 'none'}")
    for key in self.required(name):
      if key not in kwargs:
        raise ValueError(f"{self.plane} {name!r} needs {key!r}; valid keys: "
                         f"{', '.join(keys)}")

  def make(self, name: str, *args: Any, **kwargs: Any) -> Any:
    """Checks the arguments, then calls the factory registered as `name`."""
    self.check(name, kwargs)
    return self.factory(name)(*args, **kwargs)
