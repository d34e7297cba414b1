"""goodput: route to the pods with the most SLO headroom; refuse what no pod can serve in time.

Goodput counts only requests that meet both SLOs, so a request that would miss them is better
queued at the router (or rejected with 429) than admitted to slow everyone else down. Headroom is in
units of the SLO: 1 - predicted / slo (1 = idle, 0 = exactly at the SLO, < 0 = a miss). A pair's
headroom is the smaller of its prefill pod's TTFT headroom and its decode pod's TPOT headroom;
TTFT depends only on P and TPOT only on D, so taking the best P and the best D maximises it.

The TPOT compared with the SLO is the step model's prediction, with the decode pod's typical P→D
hand-over spread over the request's tokens (`predict.client_tpot`), times the pod's calibration
factor (the 80th percentile of observed / predicted TPOT there: what the model misses of what
clients see, such as loop gaps and contention; `router.predict` says why that quantile). Each
decision carries the uncalibrated prediction so that the dispatcher can feed the calibration when
the request finishes.
"""

from __future__ import annotations

from dataclasses import replace

from router.load import PodState
from router.policy.base import NoRoute, Policy, Profile, RoutingDecision, RoutingRequest
from router.policy.kv_cache import KVCacheScorer
from router.policy.prefix_affinity import PrefixAffinityScorer, PrefixIndex
from router.predict import client_tpot, predict_tpot, predict_ttft, predict_ttft_in_steps


class LatencyPredictor:
    """Predicted TTFT / TPOT of one request on one pod, from its reports and the prefix index."""

    def __init__(self, prefix_index: PrefixIndex, default_prefill_tokens_per_second: float = 20000.0) -> None:
        self.prefix_index = prefix_index
        self.default_prefill_tokens_per_second = default_prefill_tokens_per_second

    def model_ttft(self, request: RoutingRequest, pod: PodState, calibration: float = 1.0) -> float:
        """The queue model's TTFT on this pod (uncalibrated by default): the steps its queue and
        this prompt take, priced by the pod's step model; at its measured rate until it has one."""
        uncached = self.prefix_index.uncached_tokens(request, pod.address)
        prefill_only = pod.role == "prefill"
        seconds = predict_ttft_in_steps(
            pod.step_model, pod.queued_prefill_tokens + uncached, pod.max_num_batched_tokens,
            num_seqs=pod.num_requests + 1, num_context_tokens=0 if prefill_only else pod.context_tokens,
            fallback_step_seconds=pod.step_seconds_ewma)
        if seconds is not None:
            return calibration * seconds
        rate = pod.report.prefill_tokens_per_second if pod.report is not None else 0.0
        if rate <= 0:
            rate = self.default_prefill_tokens_per_second
        return predict_ttft(pod.queued_prefill_tokens, uncached, rate, calibration)

    def ttft(self, request: RoutingRequest, pod: PodState) -> float:
        """The TTFT quantile a client would see: the queue model times the pod's calibration."""
        return self.model_ttft(request, pod, pod.ttft_calibration.factor)

    def model_tpot(self, request: RoutingRequest, pod: PodState, calibration: float = 1.0) -> float:
        """The step model's TPOT with this request added to the pod's batch (uncalibrated by default)."""
        return predict_tpot(pod.step_model, pod.num_requests + 1, pod.context_tokens + request.num_prompt_tokens,
                            pod.step_seconds_ewma, calibration)

    def tpot(self, request: RoutingRequest, pod: PodState) -> float:
        """The TPOT quantile a client would see: the model's step, on a decode pod with its typical
        P→D hand-over spread over the request's tokens (once it has seen some), times the pod's
        calibration."""
        step = self.model_tpot(request, pod)
        gap = pod.pd_gap.value if pod.role == "decode" else None
        tpot = step if gap is None else client_tpot(step, gap, request.max_tokens)
        return pod.tpot_calibration.factor * tpot

    def headroom(self, request: RoutingRequest, pod: PodState) -> float:
        """1 - predicted / SLO for what this pod decides (TTFT, TPOT, or both when colocated)."""
        values = []
        if pod.role in ("prefill", "colocated"):
            values.append(1.0 - self.ttft(request, pod) / request.slo_ttft_seconds)
        if pod.role in ("decode", "colocated"):
            values.append(1.0 - self.tpot(request, pod) / request.slo_tpot_seconds)
        return min(values)


class SLOFilter:
    """Keeps only pods predicted to meet the request's SLO, and idle pods.

    An idle pod stays: if even an idle pod would miss, the request's own size or the pod's speed
    is the cause and waiting cannot help; and refusing work to an idle pod whose measured rate is
    stale (low) would starve it of the very work that refreshes the measurement. Unless the wait
    is the cause: a request that waited in the router's queue until the TTFT it has left is less
    than an idle pod needs, but would have met its whole budget there, would miss for certain and
    take a decode slot from one that can still meet it (a prefill pod that counts only its own
    prefills is idle most of the time, so this is no corner case under overload: session 17).
    """

    name = "slo"

    def __init__(self, predictor: LatencyPredictor) -> None:
        self.predictor = predictor

    def filter(self, request: RoutingRequest, pods: list[PodState]) -> list[PodState]:
        return [p for p in pods if self.predictor.headroom(request, p) >= 0.0
                or _idle(p) and not self._late(request, p)]

    def _late(self, request: RoutingRequest, pod: PodState) -> bool:
        """It misses on `pod` only because it waited: with its whole TTFT budget it would fit."""
        if request.waited_seconds <= 0:
            return False
        whole = replace(request, slo_ttft_seconds=request.slo_ttft_seconds + request.waited_seconds,
                        waited_seconds=0.0)
        return self.predictor.headroom(whole, pod) >= 0.0


def _idle(pod: PodState) -> bool:
    return pod.num_requests == 0 and pod.queued_prefill_tokens == 0


class SLOHeadroomScorer:
    """Headroom clamped to [0, 1]: the idlest pod relative to the SLO scores highest."""

    name = "slo_headroom"

    def __init__(self, predictor: LatencyPredictor) -> None:
        self.predictor = predictor

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        return {p.address: self.predictor.headroom(request, p) for p in pods}


class GoodputPolicy(Policy):
    name = "goodput"

    def __init__(self, predictor: LatencyPredictor) -> None:
        self.predictor = predictor
        slo_filter, headroom = SLOFilter(predictor), SLOHeadroomScorer(predictor)
        affinity = PrefixAffinityScorer(predictor.prefix_index)
        super().__init__(
            prefill=Profile(filters=[slo_filter], scorers=[(headroom, 1.0), (affinity, 0.25)]),
            decode=Profile(filters=[slo_filter], scorers=[(headroom, 1.0), (KVCacheScorer(), 0.1)]),
            colocated=Profile(filters=[slo_filter], scorers=[(headroom, 1.0), (affinity, 0.25)]),
        )

    def route(self, request: RoutingRequest, pods_by_role: dict[str, list[PodState]]) -> RoutingDecision | NoRoute:
        decision = super().route(request, pods_by_role)
        if isinstance(decision, NoRoute):
            return decision
        # Only a fitted model's prediction calibrates: the EWMA fallback means something else.
        tpot = self.predictor.model_tpot(request, decision.decode) if decision.decode.step_model.fitted else None
        ttft = self.predictor.model_ttft(request, decision.prefill or decision.decode)
        return replace(decision, predicted_tpot_seconds=tpot, predicted_ttft_seconds=ttft)

    def retry_after(self, request: RoutingRequest, pods: list[PodState]) -> float:
        """How long until the least-late pod would meet the SLO: its predicted excess latency."""
        excess = []
        for pod in pods:
            if pod.role == "decode":
                # A decode batch frees a slot when some request finishes; no report says when,
                # so come back after a second.
                excess.append(1.0)
            else:
                excess.append(self.predictor.ttft(request, pod) - request.slo_ttft_seconds)
        return max(1.0, min(excess, default=1.0))
