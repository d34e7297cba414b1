"""argparse value types shared by the `cbserve` subcommands (`cbserve.cli`, `cbserve.up`)."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """argparse type: an int >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def gpu_memory_utilization(value: str) -> float:
    """argparse type: a float in (0, 1]."""
    share = float(value)
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return share
