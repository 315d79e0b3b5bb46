"""Which task each compiled op belongs to, for reading profiler traces.

The tick names each task's ops `stage<s>/<kind>` and the update's `update`
(`jax.named_scope`). XLA keeps those names in each instruction's metadata;
on XLA:CPU a profiler trace names an event by its instruction alone
(`fusion.12`), so a reader maps it back through the compiled program's text.
"""

import re

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"",
    re.M)
_TASK = re.compile(r"(stage\d+/[A-Z]+|update)(?:/|$)")


def task_of_ops(compiled_text: str) -> dict[str, str]:
  """`instruction name -> "stage<s>/<kind>" or "update"` for every op of a
  compiled step (`pipe.compile(state, x, y).as_text()`) under a task's
  scope; the innermost scope where scopes nest."""
  out = {}
  for name, op_name in _INSTRUCTION.findall(compiled_text):
    tasks = _TASK.findall(op_name)
    if tasks:
      out[name] = tasks[-1]
  return out
