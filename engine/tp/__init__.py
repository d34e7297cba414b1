"""Tensor parallelism: rank 0's driver, the other ranks' worker, their collectives, sharding and KV commands."""
