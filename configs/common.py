"""Helpers shared by the config files.

`parse_arg` reads the string after the colon in `--config=configs/x.py:arg`,
after big_vision's `configs/common.py: parse_arg`.
"""

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses `"key=value,key=value"` into a ConfigDict over `defaults`.

  A bare value without `key=` sets the first key. Values take the type of
  their default (bools accept True/False, 1/0).

  Args:
    arg: the config argument, or None for all defaults.
    **defaults: every accepted key with its default value.

  Returns:
    The defaults, updated from `arg`.

  Examples:
    >>> parse_arg("variant=vgg_digits,steps=8", variant="mlp_digits", steps=0)
    steps: 8
    variant: vgg_digits
    <BLANKLINE>
  """
  parsed = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    if not eq:
      key, value = next(iter(defaults)), item
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is invalid; valid: "
                       f"{', '.join(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      if value not in ("True", "False", "1", "0"):
        raise ValueError(f"config argument {key}={value!r} is invalid; valid: "
                         "True or False")
      parsed[key] = value in ("True", "1")
    else:
      try:
        parsed[key] = kind(value)
      except ValueError:
        raise ValueError(f"config argument {key}={value!r} is invalid; "
                         f"valid: a value of type {kind.__name__}") from None
  return parsed


def check_choice(key: str, value: str, valid) -> None:
  """One line (ValueError) when `value` is not one of `valid`.

  Examples:
    >>> check_choice("rule", "wp9", ("wp1", "wp3"))
    Traceback (most recent call last):
    ...
    ValueError: rule='wp9' is invalid; valid: wp1, wp3
  """
  if value not in valid:
    raise ValueError(f"{key}={value!r} is invalid; valid: {', '.join(valid)}")
