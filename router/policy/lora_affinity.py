"""LoRA affinity: prefer pods where the request's adapter is already in a device slot.

Scores follow the Gateway API inference extension's `lora-affinity-scorer`, read from the pods'
load reports: the adapter resident in a slot (no copy; its requests batch together) 1.0; a slot
free (an adapter copy, then it runs) 0.8; its requests already queued there (it will be loaded
once a slot frees) 0.6; every slot busy with other adapters (the request waits at the head of
the line) 0.0. A request for the base model scores 1.0 everywhere. Pods that do not serve the
adapter never reach the scorer: the dispatcher routes an adapter's requests among the pods that
serve it only (`router.dispatch`), so a decode pod prefills locally if no prefill pod has it.
"""

from __future__ import annotations

from router.load import PodState
from router.lora.state import adapters_of
from router.policy.base import RoutingRequest

RESIDENT, FREE_SLOT, QUEUED, FULL = 1.0, 0.8, 0.6, 0.0


def lora_affinity(pod: PodState, name: str) -> float:
    adapters = adapters_of(pod)
    mine = adapters.get(name)
    if mine is not None and mine.resident:
        return RESIDENT
    busy = sum(1 for a in adapters.values() if a.num_running > 0)
    max_loras = pod.report.max_loras if pod.report is not None else 0
    if busy < max_loras:
        return FREE_SLOT
    if mine is not None and mine.num_waiting > 0:
        return QUEUED
    return FULL


class LoRAAffinityScorer:
    name = "lora_affinity"

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        if not request.lora_name:
            return {p.address: 1.0 for p in pods}
        return {p.address: lora_affinity(p, request.lora_name) for p in pods}
