"""Cluster configurations by name, shared by the benchmark (`bench/goodput.py`) and the planner.

Names: the benchmark's fixed ones (`pd-goodput`, `pd-round-robin`, `colocated-2`), `colocated-K`
(K colocated engines), and `xPyD` (x prefill and y decode pods, e.g. `2P3D`); any of the last two
may end in `-<policy>` (`goodput`, `round-robin`, `least-loaded`; default goodput), e.g.
`1P1D-round-robin`. A name maps to `ClusterSpec` fields.
"""

from __future__ import annotations

import re

NAMED: dict[str, dict] = {
    "pd-goodput": dict(num_prefill=1, num_decode=1, policy="goodput"),
    "pd-round-robin": dict(num_prefill=1, num_decode=1, policy="round_robin"),
    "colocated-2": dict(num_colocated=2, policy="goodput"),
}
POLICY_SUFFIXES = {"goodput": "goodput", "round-robin": "round_robin", "least-loaded": "least_loaded"}
_PATTERN = re.compile(r"^(?:colocated-(?P<k>\d+)|(?P<p>\d+)P(?P<d>\d+)D)(?:-(?P<policy>[a-z-]+))?$")


def parse_config(name: str) -> dict:
    """`ClusterSpec` fields for a configuration name; ValueError names what is wrong."""
    if name in NAMED:
        return dict(NAMED[name])
    match = _PATTERN.match(name)
    if match is None:
        raise ValueError(f"unknown configuration {name!r}: use {', '.join(NAMED)}, colocated-K or xPyD "
                         f"(e.g. 2P3D), optionally with -{'|-'.join(POLICY_SUFFIXES)}")
    suffix = match["policy"] or "goodput"
    if suffix not in POLICY_SUFFIXES:
        raise ValueError(f"configuration {name!r}: unknown policy {suffix!r} (use {', '.join(POLICY_SUFFIXES)})")
    policy = POLICY_SUFFIXES[suffix]
    if match["k"] is not None:
        if int(match["k"]) < 1:
            raise ValueError(f"configuration {name!r}: needs at least one colocated engine")
        return dict(num_colocated=int(match["k"]), policy=policy)
    if int(match["p"]) < 1 or int(match["d"]) < 1:
        raise ValueError(f"configuration {name!r}: needs at least one prefill and one decode pod")
    return dict(num_prefill=int(match["p"]), num_decode=int(match["d"]), policy=policy)


def num_pods(fields: dict) -> int:
    """Pods (one device each) a configuration uses."""
    return fields.get("num_colocated", 0) or fields["num_prefill"] + fields["num_decode"]


def is_disaggregated(fields: dict) -> bool:
    return not fields.get("num_colocated", 0)


def config_name(argument: str) -> str:
    """argparse type: a configuration name, checked."""
    import argparse

    try:
        parse_config(argument)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return argument
