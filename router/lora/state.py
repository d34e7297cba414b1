"""Adapters as the pods report them (`LoadReport.lora_adapters`), read per routing decision."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from router.load import PodState


def adapters_of(pod: PodState) -> dict:
    """name -> `LoRAAdapterState` of the adapters `pod` last reported."""
    report = pod.report
    return {} if report is None else {a.name: a for a in report.lora_adapters}


def serves(pod: PodState, name: str) -> bool:
    """`pod` takes requests for adapter `name` (registered there, by its last report)."""
    report = pod.report
    return report is not None and any(a.name == name and a.registered for a in report.lora_adapters)


def served_adapters(pods: Iterable[PodState]) -> list[str]:
    """Every adapter some routable pod serves, sorted."""
    return sorted({a.name for p in pods if p.report is not None and p.routable
                   for a in p.report.lora_adapters if a.registered})


def prefix_root(name: str | None) -> int:
    """The router's prefix-index chain root for adapter `name` (0: the base model), so prefix
    affinity never counts another adapter's blocks. Stable across processes (not `hash(str)`)."""
    if not name:
        return 0
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
