"""The executor stays readable: short functions, no names of task kinds."""

import ast
import pathlib
import re

PIPELINE = pathlib.Path(__file__).resolve().parents[1] / "stalepipe" / "pipeline"


def test_no_function_in_the_pipeline_package_is_over_60_lines():
  long = []
  for path in sorted(PIPELINE.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > 60:
          long.append(f"{path.name}:{node.name} ({lines} lines)")
  assert not long, long


def test_the_executors_never_compare_task_kind_names():
  """Kinds are asked what they do (`schedules/kinds.py`), never named."""
  named = re.compile(r"""kind\s*(==|!=|in|not in)\s*[("'\[]""")
  found = [f"{p.name}:{i + 1}" for p in sorted(PIPELINE.glob("*.py"))
           for i, line in enumerate(p.read_text().splitlines())
           if named.search(line)]
  assert not found, found
