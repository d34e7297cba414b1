"""Sampling: parameters, the batched sampler and its random draws, the screen that skips stages."""
