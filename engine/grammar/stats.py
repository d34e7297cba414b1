"""What structured outputs did in an engine between two reports, and its wire form.

A pod's engine core takes a `StructuredStats` from the engine after every step and sends it in
the step's `CoreEvents` (only when something happened); the pod's server process turns it into
its Prometheus metrics (`engine.metrics.EngineMetrics.structured_outputs`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.grammar.compiler import CompileStats


@dataclass
class StructuredStats:
    requests: Counter = field(default_factory=Counter)               # new structured requests, by kind
    first_token_rejected: Counter = field(default_factory=Counter)   # decode role, by reason
    compile: CompileStats = field(default_factory=CompileStats)

    @property
    def empty(self) -> bool:
        return not (self.requests or self.first_token_rejected or self.compile.compile_seconds
                    or self.compile.cache_hits)


def structured_stats_to_pb(stats: StructuredStats, events) -> None:
    """Into `events.structured_outputs` (a `cbserve_pb2.CoreEvents`), unless nothing happened."""
    if stats.empty:
        return
    msg = events.structured_outputs
    msg.request_kinds.extend(kind for kind, n in stats.requests.items() for _ in range(n))
    msg.compile_seconds.extend(stats.compile.compile_seconds)
    msg.compile_cache_hits = stats.compile.cache_hits
    msg.first_token_rejected_fingerprint = stats.first_token_rejected["fingerprint"]
    msg.first_token_rejected_token = stats.first_token_rejected["token"]
