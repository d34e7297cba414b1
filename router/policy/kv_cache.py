"""KV-cache scorer: the share of a pod's KV blocks that are free (a full pod will preempt)."""

from __future__ import annotations

from router.load import PodState
from router.policy.base import RoutingRequest


class KVCacheScorer:
    name = "kv_cache"

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        return {p.address: p.free_block_ratio for p in pods}
