"""Pipeline executors: the sequential oracle and the shard_map executor."""
