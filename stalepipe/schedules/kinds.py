"""Task kinds as data: what each kind of task consumes, produces and closes.

Every consumer of a schedule (the program compiler, the executors, the
simulator, the renderer, the theory checks) asks a task's `TaskKind` instead
of comparing its name, so a new kind is declared here once.

What a task on stage s of micro-batch m touches:

- `input`: the stage's input (stage 0: the data; else stage s-1's output);
- `output_cotangent`: the cotangent of the stage's output (from stage s+1's
  backward; on the last stage, from the loss, which a kind that runs the
  forward computes itself);
- `output`: the stage's output, sent to stage s+1 (last stage: the loss);
- `input_cotangent`: the cotangent of the stage's input, sent to stage s-1;
- `weight_gradient`: the gradient of the stage's weights, accumulated into
  the minibatch's update.

A stage applies a minibatch's update at the end of its last task that
produces a weight gradient (`closes_update`). A micro-batch is held on a stage
from the start of its first task there to the end of its last.

Examples:
  >>> sorted(KINDS["B"].produces)
  ['input_cotangent', 'weight_gradient']
  >>> [k.name for k in KINDS.values() if k.closes_update]
  ['B', 'FB', 'BW']
  >>> [k.name for k in KINDS.values() if k.splits_backward]
  ['BI', 'BW']
"""

from typing import NamedTuple

INPUT, OUTPUT_COTANGENT = "input", "output_cotangent"
OUTPUT, INPUT_COTANGENT, WEIGHT_GRADIENT = ("output", "input_cotangent",
                                            "weight_gradient")


class TaskKind(NamedTuple):
  """One kind of task, declared once."""

  name: str  # the name schedules use in `Task.kind`
  description: str  # for legends and error messages
  duration: int  # ticks a task of this kind occupies by default
  consumes: frozenset  # of INPUT, OUTPUT_COTANGENT
  produces: frozenset  # of OUTPUT, INPUT_COTANGENT, WEIGHT_GRADIENT
  colour: str  # Gantt-chart colour

  @property
  def runs_forward(self) -> bool:
    """Whether the task computes the stage's output (or the loss)."""
    return OUTPUT in self.produces

  @property
  def runs_backward(self) -> bool:
    """Whether the task computes any gradient."""
    return bool({INPUT_COTANGENT, WEIGHT_GRADIENT} & self.produces)

  @property
  def closes_update(self) -> bool:
    """Whether the minibatch's update may follow this task (its gradient)."""
    return WEIGHT_GRADIENT in self.produces

  @property
  def splits_backward(self) -> bool:
    """Whether the task computes one of the two gradients only (zero-bubble's
    input- or weight-gradient task)."""
    return self.runs_backward and not {INPUT_COTANGENT,
                                       WEIGHT_GRADIENT} <= self.produces

  @property
  def last_stage_only(self) -> bool:
    """A backward that runs the forward too takes its cotangent from the loss."""
    return self.runs_forward and self.runs_backward


def _kind(name, description, duration, consumes, produces, colour):
  return TaskKind(name, description, duration, frozenset(consumes),
                  frozenset(produces), colour)


# Forward blue, backward green, fused teal: the palette of the papers' figures.
KINDS = {k.name: k for k in (
    _kind("F", "forward", 1, {INPUT}, {OUTPUT}, "#6fa8dc"),
    _kind("B", "backward", 1, {INPUT, OUTPUT_COTANGENT},
          {INPUT_COTANGENT, WEIGHT_GRADIENT}, "#93c47d"),
    _kind("FB", "forward+backward", 2, {INPUT},
          {OUTPUT, INPUT_COTANGENT, WEIGHT_GRADIENT}, "#76b7b2"),
    # Zero-bubble's split backward (Qi et al, ICLR 2024, §2: "B" and "W"):
    # the previous stage waits for the input gradient only; the weight
    # gradient may run any time later, filling bubbles.
    _kind("BI", "input gradient", 1, {INPUT, OUTPUT_COTANGENT},
          {INPUT_COTANGENT}, "#38761d"),
    _kind("BW", "weight gradient", 1, {INPUT, OUTPUT_COTANGENT},
          {WEIGHT_GRADIENT}, "#b6d7a8"),
)}


def kind(name: str) -> TaskKind:
  """The kind registered under `name`."""
  if name not in KINDS:
    raise ValueError(f"task kind {name!r} is invalid; valid: "
                     f"{', '.join(KINDS)}")
  return KINDS[name]


def names(predicate=lambda k: True) -> tuple[str, ...]:
  """Names of the kinds for which `predicate(kind)` holds, in declared order."""
  return tuple(k.name for k in KINDS.values() if predicate(k))
