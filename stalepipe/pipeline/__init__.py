"""Pipeline executors: the sequential oracle and the shard_map executor.

`executor` (the `Pipeline`), `tick` (one tick as pure functions), `state`
(the typed state), `dispatch` (how a tick picks each stage's task), `program`
(instruction tables), `residuals` (`remat="residuals"`), `split_backward`
(zero-bubble's input- and weight-gradient tasks), `contract` (the
update-rule contract), `packing`, `boundary` (pytrees between stages, each
leaf in its own dtype), `stage` (a stage's `key` and `train` arguments),
`scope` (whole-model update rules), and `reference` (the oracle).
"""

from stalepipe.pipeline import boundary

from stalepipe.pipeline import contract
from stalepipe.pipeline import dispatch
from stalepipe.pipeline import executor
from stalepipe.pipeline import program
from stalepipe.pipeline import reference
from stalepipe.pipeline import scope
from stalepipe.pipeline import stage
from stalepipe.pipeline import residuals
from stalepipe.pipeline import split_backward
from stalepipe.pipeline import state
from stalepipe.pipeline import tick

Pipeline = executor.Pipeline
process_slice = executor.process_slice
