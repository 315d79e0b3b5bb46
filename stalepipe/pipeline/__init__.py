"""Pipeline executors: the sequential oracle and the shard_map executor."""

from stalepipe.pipeline import executor
from stalepipe.pipeline import program
from stalepipe.pipeline import reference
