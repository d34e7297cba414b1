"""Prometheus metrics of one engine (names are part of the interface: DESIGN.md §7).

Every metric carries the label `role`, so one PromQL query can select a pool. The registry is
the pod's own (never the global default), so several engines can live in one test process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.lora.metrics import LoRAMetrics
from engine.outputs import EngineStats
from engine.spec_decode.metrics import SpecDecodeMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["role"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(role)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(role)

        self.ttft = hist("cbserve_time_to_first_token_seconds", "Time to first token as this process sees it",
                         LATENCY_BUCKETS)
        self.tpot = hist("cbserve_time_per_output_token_seconds", "Time per output token after the first",
                         TPOT_BUCKETS)
        self.e2e = hist("cbserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                        LATENCY_BUCKETS)
        self.kv_transfer = hist("cbserve_kv_transfer_seconds", "KV transfer time per request", LATENCY_BUCKETS)
        self.step = hist("cbserve_step_seconds", "Engine step time", TPOT_BUCKETS)
        # The decode pod's share of the prefill->decode gap (the router's `kv_transfer` and
        # `decode` phases straddle it): KV pulled -> landed in the batch -> first decode step out.
        self.decode_first_step = hist(
            "cbserve_decode_first_step_seconds",
            "Decode pod: KV pull done to the request's second token (KV landing + first decode step)",
            TPOT_BUCKETS)
        self.running = gauge("cbserve_requests_running", "Requests in the running batch")
        self.waiting = gauge("cbserve_requests_waiting", "Requests queued (incl. waiting for blocks)")
        self.prefill_queue_tokens = gauge("cbserve_prefill_queue_tokens", "Prompt tokens not yet computed")
        self.kv_usage = gauge("cbserve_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self.prefix_hit = gauge("cbserve_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache")
        self.held_kv = gauge("cbserve_held_kv_requests", "Prefilled requests whose KV waits for a pull")
        self._requests = Counter("cbserve_requests", "Finished requests by status", ["role", "status"], registry=r)
        self.preemptions = Counter("cbserve_preemptions", "Preemptions by recompute", labels, registry=r).labels(role)
        self.kv_bytes = Counter("cbserve_kv_transfer_bytes", "KV bytes moved between pods", labels,
                                registry=r).labels(role)
        self._rejected = Counter("cbserve_rejected", "Requests refused, by reason", ["role", "reason"], registry=r)
        self.lease_expiries = Counter("cbserve_kv_lease_expired", "Held KV released by TTL, never pulled",
                                      labels, registry=r).labels(role)
        self.local_prefill_fallbacks = Counter(
            "cbserve_local_prefill_fallbacks", "Decode-pod local prefills after a failed KV pull", labels,
            registry=r).labels(role)
        self.spec_decode = SpecDecodeMetrics(role, r)   # cbserve_spec_decode_* (engine/spec_decode/metrics.py)
        self.lora = LoRAMetrics(role, r)
        # Structured outputs (vLLM has no names for these; the cbserve_structured_output_ family).
        self._structured_requests = Counter("cbserve_structured_output_requests",
                                            "Requests with a structured-output spec, by kind", ["role", "kind"],
                                            registry=r)
        self.grammar_compile = hist("cbserve_structured_output_compile_seconds",
                                    "Grammar compile time (cache misses)", COMPILE_BUCKETS)
        self.grammar_cache_hits = Counter("cbserve_structured_output_compile_cache_hits",
                                          "Grammar compiles served from the cache", labels, registry=r).labels(role)
        self._first_token_rejected = Counter(
            "cbserve_structured_output_first_token_rejected",
            "Decode pod: prefill pod first tokens refused (grammar fingerprint or token), prefilled locally",
            ["role", "reason"], registry=r)
        self._last_preemptions = 0

    def request_finished(self, status: str) -> None:
        self._requests.labels(self.role, status).inc()

    def structured_outputs(self, msg) -> None:
        """A `cbserve_pb2.StructuredOutputStats` from the engine core."""
        for kind in msg.request_kinds:
            self._structured_requests.labels(self.role, kind).inc()
        for seconds in msg.compile_seconds:
            self.grammar_compile.observe(seconds)
        if msg.compile_cache_hits:
            self.grammar_cache_hits.inc(msg.compile_cache_hits)
        for reason, count in (("fingerprint", msg.first_token_rejected_fingerprint),
                              ("token", msg.first_token_rejected_token)):
            if count:
                self._first_token_rejected.labels(self.role, reason).inc(count)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.role, reason).inc()

    def update(self, stats: EngineStats, num_held: int = 0) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.prefill_queue_tokens.set(stats.prefill_queue_tokens)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit.set(stats.prefix_cache_hit_ratio)
        self.held_kv.set(num_held)
        self.spec_decode.update(stats.spec_decode)
        self.lora.update(stats.lora_adapters, stats.max_loras)
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
