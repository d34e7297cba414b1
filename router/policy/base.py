"""The routing interface: filter -> score in [0, 1] (weighted) -> pick, one Profile per pod role.

A `Policy` routes one request to a (prefill, decode) pair, or to one colocated pod. Each role has a
`Profile`: filters drop pods that must not get the request, scorers rate the rest in [0, 1], the
weighted sum decides, and the picker breaks ties at random (so equal pods share load). Filters and
scorers are small objects in their own files; a policy is just a choice of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from router.load import PodState


@dataclass(frozen=True)
class RoutingRequest:
    """What routing needs to know about a request (no text, no sampling details)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    slo_ttft_seconds: float
    slo_tpot_seconds: float
    block_hashes: tuple[int, ...] = ()       # chain hashes of the prompt's full blocks
    block_size: int = 16
    exclude: frozenset[str] = frozenset()    # addresses already tried (retries go elsewhere)
    lora_name: str = ""                      # LoRA adapter; "" = the base model
    # Seconds it waited in the router's queue for SLO headroom, already taken off
    # `slo_ttft_seconds` (`router.dispatch.with_ttft_budget_left`).
    waited_seconds: float = 0.0


class Filter(Protocol):
    name: str

    def filter(self, request: RoutingRequest, pods: list[PodState]) -> list[PodState]: ...


class Scorer(Protocol):
    name: str

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        """Score per pod address, each in [0, 1]; higher is better."""
        ...


class Picker(Protocol):
    def pick(self, pods: list[PodState], scores: dict[str, float]) -> PodState: ...


class MaxScorePicker:
    """The highest total score; ties broken uniformly at random."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, pods: list[PodState], scores: dict[str, float]) -> PodState:
        best = max(scores[p.address] for p in pods)
        tied = [p for p in pods if scores[p.address] >= best - 1e-9]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)


@dataclass
class Profile:
    """Filters, weighted scorers and a picker for the pods of one role."""

    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    picker: Picker = field(default_factory=MaxScorePicker)

    def run(self, request: RoutingRequest, pods: list[PodState]) -> tuple[PodState | None, str | None]:
        """The chosen pod, or (None, name of the filter that left no pod)."""
        pods = [p for p in pods if p.address not in request.exclude]
        if not pods:
            return None, "no_pods"
        for f in self.filters:
            pods = f.filter(request, pods)
            if not pods:
                return None, f.name
        totals = {p.address: 0.0 for p in pods}
        for scorer, weight in self.scorers:
            for address, value in scorer.score(request, pods).items():
                totals[address] += weight * min(1.0, max(0.0, value))
        return self.picker.pick(pods, totals), None


@dataclass(frozen=True)
class RoutingDecision:
    """Where a request goes: `prefill` is None for a colocated pod (then `decode` is that pod), or
    for a decode pod that prefills locally because no prefill pod is routable.

    `predicted_tpot_seconds` is the step model's uncalibrated TPOT on `decode` when the policy
    predicted one, `predicted_ttft_seconds` the queue model's uncalibrated TTFT on the pod that
    prefills; the dispatcher compares them with what it measures to calibrate those pods.
    """

    prefill: PodState | None
    decode: PodState
    predicted_tpot_seconds: float | None = None
    predicted_ttft_seconds: float | None = None


@dataclass(frozen=True)
class NoRoute:
    """Why nothing was chosen: "no_pods" (none routable) or "slo" (none predicted to meet it);
    the dispatcher turns "no_pods" into "starting" when a pod that could serve is on its way."""

    reason: str
    retry_after_seconds: float = 1.0


class Policy:
    """Routes a request to a (prefill, decode) pair or a colocated pod."""

    name = "policy"

    def __init__(self, prefill: Profile, decode: Profile, colocated: Profile) -> None:
        self.profiles = {"prefill": prefill, "decode": decode, "colocated": colocated}
        # With no prefill pod to use, a decode pod prefills the prompt itself (Generate without
        # `prefill_from`), as it does when its prefill pod dies mid-transfer: slower first tokens
        # beat a 503 while decode pods stand idle. Off: such requests get 503 at once.
        self.local_prefill_fallback = True

    def retry_after(self, request: RoutingRequest, pods: list[PodState]) -> float:
        """Seconds until a rejected request could be met; overridden by SLO-aware policies."""
        return 1.0

    def route(self, request: RoutingRequest, pods_by_role: dict[str, list[PodState]]) -> RoutingDecision | NoRoute:
        if pods_by_role.get("colocated"):
            pod, failed = self.profiles["colocated"].run(request, pods_by_role["colocated"])
            if pod is None:
                return self._no_route(failed, request, pods_by_role["colocated"])
            return RoutingDecision(None, pod)
        prefill_pods = pods_by_role.get("prefill", [])
        if self.local_prefill_fallback and all(p.address in request.exclude for p in prefill_pods):
            # No prefill pod is routable (none configured, all down, or every one failed this
            # request): the decode pod prefills locally, routed like a decode.
            decode, failed = self.profiles["decode"].run(request, pods_by_role.get("decode", []))
            if decode is None:
                return self._no_route(failed, request, pods_by_role.get("decode", []))
            return RoutingDecision(None, decode)
        prefill, failed = self.profiles["prefill"].run(request, prefill_pods)
        if prefill is None:
            return self._no_route(failed, request, prefill_pods)
        decode, failed = self.profiles["decode"].run(request, pods_by_role.get("decode", []))
        if decode is None:
            return self._no_route(failed, request, pods_by_role.get("decode", []))
        return RoutingDecision(prefill, decode)

    def _no_route(self, failed: str | None, request: RoutingRequest, pods: list[PodState]) -> NoRoute:
        if failed == "slo":
            return NoRoute("slo", self.retry_after(request, pods))
        return NoRoute("no_pods")
