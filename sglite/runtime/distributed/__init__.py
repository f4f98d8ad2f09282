"""Tensor parallelism: the process group and its collectives (`parallel.py`) and how a model
is cut into per-rank shards (`sharding.py`)."""
