"""Per-run statistics of the goodput benchmark: percentiles, SLO attainment and goodput.

Accounting (cancelled requests were closed by the client on purpose, so they count in the offered
load but neither for nor against the server):
- completed req/s = finished requests / elapsed, where elapsed runs from the run's start until
  the last request ended (an overloaded server's backlog counts against it);
- a request meets the SLO when it finished, its TTFT <= the TTFT SLO and its TPOT <= the TPOT SLO
  (a one-token answer has no TPOT and meets that part);
- SLO attainment = requests meeting the SLO / requests not cancelled;
- goodput = requests meeting the SLO / elapsed (DistServe's "goodput", per second);
- error rate = (rejected + error + timeout) / requests not cancelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Outcomes: ok (finished), cancelled (closed by us on purpose), rejected (429/503 before any token),
# error (any other HTTP status, an SSE error event, a broken stream), timeout (past the request timeout).
OUTCOMES = ("ok", "cancelled", "rejected", "error", "timeout")


@dataclass
class RequestResult:
    """What the client saw of one request; times are seconds since the run's start."""

    index: int
    scheduled_s: float
    sent_s: float = 0.0
    outcome: str = "error"
    http_status: int | None = None
    error: str | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    done_s: float | None = None
    num_chunks: int = 0
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_s is None or self.last_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, result: RequestResult) -> bool:
        if result.outcome != "ok" or result.ttft_s is None or result.ttft_s > self.ttft_s:
            return False
        tpot = result.tpot_s
        return tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class RunSummary:
    """One row of the benchmark table (times in seconds, rates per second)."""

    rate: float                    # nominal offered rate
    offered_rps: float             # requests actually scheduled / duration (the Poisson draw)
    completed_rps: float
    goodput_rps: float
    slo_attainment: float
    error_rate: float
    p50_ttft_s: float | None
    p95_ttft_s: float | None
    p95_tpot_s: float | None
    p95_e2e_s: float | None
    p95_router_queue_s: float | None   # from the router's histogram (None when not scraped)
    preemptions: int | None            # from the pods' counters (None when not scraped)
    num_requests: int
    num_ok: int
    num_cancelled: int
    num_rejected: int
    num_errors: int
    num_timeouts: int
    duration_s: float
    elapsed_s: float
    max_send_lag_s: float          # how late the client sent a request (client overload shows here)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: Sequence[RequestResult], *, rate: float, duration_s: float, elapsed_s: float, slo: Slo,
              p95_router_queue_s: float | None = None, preemptions: int | None = None) -> RunSummary:
    """Fold one run's per-request results into its table row."""
    by_outcome = {o: [r for r in results if r.outcome == o] for o in ("ok", "cancelled", "rejected", "error", "timeout")}
    ok = by_outcome["ok"]
    not_cancelled = len(results) - len(by_outcome["cancelled"])
    elapsed = max(elapsed_s, 1e-9)
    num_met = sum(slo.met(r) for r in results)
    failed = len(by_outcome["rejected"]) + len(by_outcome["error"]) + len(by_outcome["timeout"])
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return RunSummary(
        rate=rate, offered_rps=len(results) / duration_s, completed_rps=len(ok) / elapsed,
        goodput_rps=num_met / elapsed, slo_attainment=num_met / not_cancelled if not_cancelled else 0.0,
        error_rate=failed / not_cancelled if not_cancelled else 0.0,
        p50_ttft_s=percentile(ttfts, 50), p95_ttft_s=percentile(ttfts, 95), p95_tpot_s=percentile(tpots, 95),
        p95_e2e_s=percentile([r.e2e_s for r in ok if r.e2e_s is not None], 95),
        p95_router_queue_s=p95_router_queue_s, preemptions=preemptions,
        num_requests=len(results), num_ok=len(ok), num_cancelled=len(by_outcome["cancelled"]),
        num_rejected=len(by_outcome["rejected"]), num_errors=len(by_outcome["error"]),
        num_timeouts=len(by_outcome["timeout"]), duration_s=duration_s, elapsed_s=elapsed_s,
        max_send_lag_s=max((r.sent_s - r.scheduled_s for r in results), default=0.0))
