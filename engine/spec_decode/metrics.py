"""Speculative decoding's Prometheus metrics (vLLM's names), from the engine's cumulative counts.

`engine.spec_decode.stats.SpecDecodeStats` is what the engine counts; it travels to a pod's server process inside
`CoreStats.spec_decode` and becomes, with the `cbserve_` prefix of DESIGN.md §7:
- `cbserve_spec_decode_num_drafts_total`: verifications (request-steps with at least one draft);
- `cbserve_spec_decode_num_draft_tokens_total`, `cbserve_spec_decode_num_accepted_tokens_total`;
- `cbserve_spec_decode_num_accepted_tokens_per_pos_total{position}`: how often draft `position`
  (0-based) was accepted (vLLM's per-position counter);
- `cbserve_spec_decode_acceptance_length`: a histogram of tokens emitted per verification (the
  accepted drafts plus the token after them: 1 to k + 1), built from the cumulative counts
  (a custom collector: the counts arrive already bucketed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import HistogramMetricFamily

from engine.spec_decode.stats import SpecDecodeStats


def stats_to_pb(stats: SpecDecodeStats, message) -> None:
    """Into a `SpecDecodeStats` proto message."""
    message.num_drafts, message.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
    message.num_accepted_tokens = stats.num_accepted_tokens
    message.accepted_per_pos[:] = stats.accepted_per_pos
    message.acceptance_lengths[:] = stats.acceptance_lengths


def stats_from_pb(message) -> SpecDecodeStats:
    return SpecDecodeStats(message.num_drafts, message.num_draft_tokens, message.num_accepted_tokens,
                           list(message.accepted_per_pos), list(message.acceptance_lengths))


class SpecDecodeMetrics:
    """The metrics of one pod, fed the engine's cumulative `SpecDecodeStats` (`update`)."""

    def __init__(self, role: str, registry: CollectorRegistry) -> None:
        self.role = role
        labels = ["role"]
        self.num_drafts = Counter("cbserve_spec_decode_num_drafts", "Speculative verifications (requests "
                                  "verified with at least one draft)", labels, registry=registry).labels(role)
        self.num_draft_tokens = Counter("cbserve_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        labels, registry=registry).labels(role)
        self.num_accepted_tokens = Counter("cbserve_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target", labels,
                                           registry=registry).labels(role)
        self._per_pos = Counter("cbserve_spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position (0-based)", ["role", "position"],
                                registry=registry)
        self._last = SpecDecodeStats()
        registry.register(_AcceptanceLengthCollector(self))

    def update(self, stats: SpecDecodeStats | None) -> None:
        if stats is None:
            return
        last = self._last
        self.num_drafts.inc(max(0, stats.num_drafts - last.num_drafts))
        self.num_draft_tokens.inc(max(0, stats.num_draft_tokens - last.num_draft_tokens))
        self.num_accepted_tokens.inc(max(0, stats.num_accepted_tokens - last.num_accepted_tokens))
        for position, count in enumerate(stats.accepted_per_pos):
            before = last.accepted_per_pos[position] if position < len(last.accepted_per_pos) else 0
            if count > before:
                self._per_pos.labels(self.role, str(position)).inc(count - before)
        self._last = stats.copy()


class _AcceptanceLengthCollector:
    """`cbserve_spec_decode_acceptance_length`, a histogram built from the cumulative counts."""

    def __init__(self, metrics: SpecDecodeMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        stats, role = self._metrics._last, self._metrics.role
        family = HistogramMetricFamily("cbserve_spec_decode_acceptance_length",
                                       "Tokens emitted per speculative verification (accepted drafts + 1)",
                                       labels=["role"])
        buckets, cumulative, total = [], 0, 0
        for length, count in enumerate(stats.acceptance_lengths, start=1):
            cumulative += count
            total += length * count
            buckets.append((str(float(length)), cumulative))
        buckets.append(("+Inf", cumulative))
        family.add_metric([role], buckets, float(total))
        yield family

    def describe(self):
        return []
