"""Constrained decoding: the spec a request carries (`spec`, torch-free: the router imports it) and,
on the pods, the grammar backend that turns a spec into a per-request matcher and a token mask."""
