"""The router's Prometheus metrics (names are part of the interface: DESIGN.md §7).

Client-facing latencies (TTFT, TPOT, end to end) plus one histogram per phase of a request's life,
`cbserve_request_phase_seconds{phase}` with phase in PHASES, so a slow request can be explained:
router queue -> prefill queue -> prefill -> KV transfer -> decode queue -> decode. `pd_gap` is the
P/D hand-over as the router sees it: P's first token to D's first token (KV pull, D's queue and
first step; part of `decode`, and of TPOT, which counts from the first token as OpenAI's does).
Every metric carries `role="router"`. Each app gets its own registry, so several routers can live
in one test.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PHASES = ("router_queue", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "pd_gap", "decode")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
ROLE = "router"


class RouterMetrics:
    """All router metrics on one registry; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["role"]
        r = self.registry
        self.ttft = Histogram("cbserve_time_to_first_token_seconds", "Time to first token as the client sees it",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(ROLE)
        self.tpot = Histogram("cbserve_time_per_output_token_seconds", "Mean time per output token after the first",
                              labels, buckets=_TPOT_BUCKETS, registry=r).labels(ROLE)
        self.e2e = Histogram("cbserve_e2e_request_latency_seconds", "Arrival to last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r).labels(ROLE)
        self.kv_transfer = Histogram("cbserve_kv_transfer_seconds", "KV transfer time the decode pod reported",
                                     labels, buckets=_LATENCY_BUCKETS, registry=r).labels(ROLE)
        self._phase = Histogram("cbserve_request_phase_seconds", "Time a request spent in each phase",
                                ["role", "phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self._phases: dict[str, object] = {}     # labelled children, made on first use (no empty series)
        self._requests = Counter("cbserve_requests", "Finished requests by status", ["role", "status"], registry=r)
        self._slo_met = Counter("cbserve_slo_met", "Requests that met an SLO (ttft, tpot, all)",
                                ["role", "slo"], registry=r)
        self._rejected = Counter("cbserve_rejected", "Requests refused by reason", ["role", "reason"], registry=r)
        self.running = Gauge("cbserve_requests_running", "Requests in flight to pods", labels, registry=r).labels(ROLE)
        self.waiting = Gauge("cbserve_requests_waiting", "Requests waiting in the router's admission queue",
                             labels, registry=r).labels(ROLE)
        self.retries = Counter("cbserve_router_retries", "Attempts retried on another pod", labels,
                               registry=r).labels(ROLE)
        self._calibration = Gauge("cbserve_router_latency_calibration",
                                  "Factor the goodput policy multiplies a pod's predicted TTFT or TPOT by "
                                  "(a high quantile of observed / predicted, router.predict's "
                                  "ttft_calibration and tpot_calibration; 1 until enough requests)", ["role", "pod", "slo"], registry=r)

    def observe_phase(self, phase: str, seconds: float) -> None:
        child = self._phases.get(phase)
        if child is None:
            assert phase in PHASES, phase
            child = self._phases[phase] = self._phase.labels(ROLE, phase)
        child.observe(max(0.0, seconds))

    def request_finished(self, status: str) -> None:
        self._requests.labels(ROLE, status).inc()

    def slo_met(self, slo: str) -> None:
        self._slo_met.labels(ROLE, slo).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(ROLE, reason).inc()

    def calibration(self, pod: str, slo: str, factor: float) -> None:
        self._calibration.labels(ROLE, pod, slo).set(factor)

    def render(self) -> bytes:
        return generate_latest(self.registry)
