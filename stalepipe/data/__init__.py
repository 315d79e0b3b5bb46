"""Data pipelines: data that ships in a package, or that is generated."""

from stalepipe.data.digits import Dataset, digits, shard
