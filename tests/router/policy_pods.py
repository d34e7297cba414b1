"""Fake pods for policy tests: PodState objects with hand-written load reports (no network)."""

from __future__ import annotations

import time

from wire import cbserve_pb2 as pb
from router.discovery.base import PodEndpoint
from router.load import LOAD_SILENCE_SECONDS, LoadTracker, PodState
from router.policy.base import RoutingRequest


REPORTS_SO_FAR = 1_000_000


def pod(address: str, role: str = "prefill", *, waiting: int = 0, running: int = 0, queued_tokens: int = 0,
        free_blocks: int = 100, total_blocks: int = 100, rate: float = 1000.0, step: float = 0.01,
        inflight: int = 0, draining: bool = False, healthy: bool = True, budget: int = 0,
        serving: bool = True, silent: bool = False) -> PodState:
    """`budget`: the reported max_num_batched_tokens (0: an older pod that does not say);
    `silent`: its last report is older than LOAD_SILENCE_SECONDS (frozen, or its loop starved)."""
    state = PodState(PodEndpoint(address, role, address), client=None)
    state.report = pb.LoadReport(pod_id=address, role=role, num_waiting=waiting, num_running=running,
                                 prefill_queue_tokens=queued_tokens, num_free_blocks=free_blocks,
                                 num_total_blocks=total_blocks, prefill_tokens_per_second=rate,
                                 step_seconds_ewma=step, draining=draining, max_num_batched_tokens=budget)
    state.report_time = time.monotonic() - (LOAD_SILENCE_SECONDS + 1 if silent else 0)
    state.report_seq = 0 if silent else REPORTS_SO_FAR   # a silent one missed the others' reports
    state.num_inflight = inflight
    state.healthy = healthy
    state.serving = serving
    return state


def tracker_of(pods: list[PodState]) -> LoadTracker:
    """A LoadTracker (no network) that has seen `REPORTS_SO_FAR` reports, holding `pods`."""
    tracker = LoadTracker()
    tracker.pods = {p.address: p for p in pods}
    tracker.num_reports = REPORTS_SO_FAR
    return tracker


def request(num_prompt_tokens: int = 100, *, slo_ttft: float = 0.5, slo_tpot: float = 0.05,
            hashes: tuple[int, ...] = (), exclude: frozenset[str] = frozenset(), max_tokens: int = 16) -> RoutingRequest:
    return RoutingRequest("r", num_prompt_tokens, max_tokens, slo_ttft, slo_tpot, hashes, 16, exclude)
