"""least_loaded: the pod with the least queued work, by its last report plus the router's own sends."""

from __future__ import annotations

from router.load import PodState
from router.policy.base import Policy, Profile, RoutingRequest
from router.policy.kv_cache import KVCacheScorer


class QueueScorer:
    """1 for the least loaded candidate, 0 for the most, linear between (llm-d's queue scorer).

    `metric` is "prefill_tokens" (queued prompt tokens: what delays a prefill) or "requests"
    (waiting + running: what slows every decode step).
    """

    def __init__(self, metric: str = "requests") -> None:
        if metric not in ("requests", "prefill_tokens"):
            raise ValueError(f"unknown queue metric {metric!r}")
        self.metric = metric
        self.name = f"queue_{metric}"

    def _load(self, pod: PodState) -> float:
        return pod.queued_prefill_tokens if self.metric == "prefill_tokens" else pod.num_requests

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        loads = {p.address: self._load(p) for p in pods}
        low, high = min(loads.values()), max(loads.values())
        if high == low:
            return {address: 1.0 for address in loads}
        return {address: (high - load) / (high - low) for address, load in loads.items()}


def least_loaded_policy() -> Policy:
    policy = Policy(
        prefill=Profile(scorers=[(QueueScorer("prefill_tokens"), 1.0), (QueueScorer("requests"), 0.1)]),
        decode=Profile(scorers=[(QueueScorer("requests"), 1.0), (KVCacheScorer(), 0.5)]),
        colocated=Profile(scorers=[(QueueScorer("requests"), 1.0), (QueueScorer("prefill_tokens"), 0.5)]),
    )
    policy.name = "least_loaded"
    return policy
