"""Running one output sequence on the pods: admit, route, call, retry before the first token.

`Dispatcher.start` admits the sequence, routes it and starts its pod calls (a `SequenceStream`:
disaggregated, `Prefill` on P and `Generate(prefill_from=P)` on D together; colocated, only
`Generate`), and returns once the first tokens have arrived. Every call carries the request's
deadline as its gRPC timeout.

Failures: a call that fails before the first token is retried on other pods (the failed pod is
excluded and, for connection-level errors, taken out of routing until a probe succeeds). After the
first token the sequence fails with `PodLost`: a streaming client sees an error event, a
non-streaming request runs the sequence again elsewhere (nothing reached its client yet). When the consumer stops early (client
disconnect, stop string found by the router), `SequenceStream.close` cancels both calls, which
frees their state on the pods, and a best-effort `Abort` follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from router.admission import STARTING_RETRY_AFTER_SECONDS, AdmissionController
from router.config import RouterConfig
from router.errors import APIError, timeout_error, unavailable, upstream_error
from router.load import LoadTracker, PodState
from router.lora.state import serves
from router.metrics import RouterMetrics
from router.pod_stream import POD_DOWN, PodFailure, SequenceStream
from router.predict import client_tpot
from router.policy import NoRoute, Policy, PrefixIndex, RoutingDecision, RoutingRequest, build_policy
from router.sequence import SequenceSpec, SequenceTrace

log = logging.getLogger(__name__)

_NOT_RETRYABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


class PodLost(APIError):
    """A pod failed a sequence after its first tokens (dead, frozen, unavailable): too late to retry
    once the client saw tokens, but a request that buffers its whole answer (non-streaming) can
    run the sequence again on other pods (`router.generation.Choice`). `failure` names the pod."""

    def __init__(self, failure: PodFailure) -> None:
        super().__init__(502, f"Generation failed: {failure}", type="server_error", code="upstream_error")
        self.failure = failure


def with_ttft_budget_left(routing: RoutingRequest, waited_seconds: float) -> RoutingRequest:
    """The request as a routing attempt after waiting `waited_seconds` for SLO headroom in the
    router's queue: its TTFT SLO shrinks by the wait, because the client's TTFT counts it. A request
    that waited most of its SLO is admitted only where it still fits (or to an idle pod), not where
    a fresh one would. (A wait for a pod to start does not count: see `router.admission`.)"""
    if waited_seconds <= 0:
        return routing
    return replace(routing, slo_ttft_seconds=max(1e-3, routing.slo_ttft_seconds - waited_seconds),
                   waited_seconds=routing.waited_seconds + waited_seconds)


class Dispatcher:
    """Routes sequences with the policy and admission control, and runs them on the pods."""

    def __init__(self, tracker: LoadTracker, policy: Policy, admission: AdmissionController,
                 prefix_index: PrefixIndex, metrics: RouterMetrics, max_retries: int = 2,
                 kv_transport: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock    # monotonic seconds; the capacity planner's is virtual (`cbserve.planner`)
        self.tracker = tracker
        self.policy = policy
        self.admission = admission
        self.prefix_index = prefix_index
        self.metrics = metrics
        self.max_retries = max_retries
        self.kv_transport = kv_transport
        self._background: set[asyncio.Task] = set()

    def pods_by_role(self, lora_name: str = "") -> dict[str, list[PodState]]:
        """Routable pods by role; with `lora_name`, only those serving that adapter (no prefill
        pod has it: the decode pod prefills locally, as when none is routable)."""
        pods = {role: self.tracker.routable(role) for role in ("prefill", "decode", "colocated")}
        return {role: [p for p in ps if serves(p, lora_name)] for role, ps in pods.items()} if lora_name else pods

    def pods_starting(self, exclude: frozenset[str] = frozenset()) -> bool:
        """Discovery knows a pod that could serve but is not routable yet: starting, restarting,
        stalled, or a replacement coming up (not one that drains: it is on its way out)."""
        roles = ("decode", "colocated") if self.policy.local_prefill_fallback else ("prefill", "decode", "colocated")
        return any(not p.routable and p.role in roles and p.address not in exclude
                   and not (p.report is not None and p.report.draining)
                   for p in self.tracker.pods.values())

    def _try_route(self, routing: RoutingRequest) -> RoutingDecision | NoRoute:
        """Route and, on success, reserve the pods at once (in-flight accounting, prefix index).
        With no pod to route to, "starting" if one is on its way (admission waits for it)."""
        decision = self.policy.route(routing, self.pods_by_role(routing.lora_name))
        if isinstance(decision, NoRoute) and decision.reason == "no_pods" and self.pods_starting(routing.exclude):
            return NoRoute("starting", STARTING_RETRY_AFTER_SECONDS)
        if isinstance(decision, RoutingDecision):
            first = decision.prefill or decision.decode
            first.on_dispatch(routing.num_prompt_tokens, self.prefix_index.uncached_tokens(routing, first.address))
            if decision.prefill is not None:
                decision.decode.on_dispatch(routing.num_prompt_tokens, 0)
            self.prefix_index.record(routing.block_hashes, first.address)
            self.metrics.running.inc()
        return decision

    def prefill_answered(self, decision: RoutingDecision) -> None:
        """The sequence's prefill pod answered (or its call failed): it takes no more of P's
        steps, so P's load no longer counts it (`PodState.on_answered`), while D goes on."""
        decision.prefill.on_answered()
        self.admission.wake()

    def release(self, decision: RoutingDecision, answered: bool = False) -> None:
        """The routed sequence is done: its pods' in-flight slots are free again (`answered`:
        `prefill_answered` was called for it)."""
        if decision.prefill is not None:
            decision.prefill.on_finish(answered)
        decision.decode.on_finish()
        self.metrics.running.dec()
        self.admission.wake()

    async def admit(self, spec: SequenceSpec, trace: SequenceTrace) -> RoutingDecision:
        """The sequence's pods, reserved, once admission lets it through (it may wait in the
        router's queue, on the TTFT budget it has left); raises APIError (429 / 503) if refused."""
        start = self.clock()
        decision = await self.admission.admit(
            lambda headroom_waited: self._try_route(with_ttft_budget_left(spec.routing, headroom_waited)),
            spec.deadline, self.release, slo_wait_seconds=spec.routing.slo_ttft_seconds)
        trace.router_queue_seconds = self.clock() - start
        self.metrics.observe_phase("router_queue", trace.router_queue_seconds)
        return decision

    async def start(self, spec: SequenceSpec, trace: SequenceTrace) -> SequenceStream:
        """The sequence's pod calls once its first tokens arrived (in `first_message`).

        Raises APIError if it cannot be served: refused by admission, no pod, or every try failed.
        """
        decision = await self.admit(spec, trace)
        routing = spec.routing
        attempt = 0
        while True:
            stream = SequenceStream(self, spec, decision, attempt, trace)
            try:
                await stream.first()
                return stream
            except PodFailure as exc:
                stream.close()
                failed = exc
            except BaseException:
                stream.close()
                raise
            error = self.failure_error(failed, retry=attempt < self.max_retries)
            if error is not None:
                raise error from None
            log.warning("request %s: %s; retrying on another pod", spec.request_id, failed)
            self.metrics.retries.inc()
            # Admission already accepted this request: a retry goes to any other pod, SLO or not.
            routing = replace(routing, exclude=routing.exclude | {failed.pod.address},
                              slo_ttft_seconds=float("inf"), slo_tpot_seconds=float("inf"))
            decision = self._try_route(routing)
            if isinstance(decision, NoRoute):
                raise unavailable(f"Generation failed and no other pod is ready: {failed}") from None
            attempt += 1

    def failure_error(self, failed: PodFailure, retry: bool) -> APIError | None:
        """Take a pod that is down out of routing; the error the client gets, or None to retry."""
        code = failed.code
        if code in POD_DOWN:
            self.tracker.mark_failed(failed.pod, f"{code.name}: {failed.details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return timeout_error("The request's deadline passed before it finished.")
        if code in _NOT_RETRYABLE:
            return upstream_error(f"Generation failed: {failed}")
        if not retry:
            return PodLost(failed)
        return None

    def observe_ttft(self, decision: RoutingDecision, ttft_seconds: float) -> None:
        """Feed the prefilling pod's TTFT calibration: routing to first token, measured here."""
        if decision.predicted_ttft_seconds is not None:
            pod = decision.prefill or decision.decode
            pod.ttft_calibration.observe(ttft_seconds, decision.predicted_ttft_seconds)
            self.metrics.calibration(pod.address, "ttft", pod.ttft_calibration.factor)

    def observe_tpot(self, decision: RoutingDecision, decode_seconds: float, num_tokens: int,
                     pd_gap_seconds: float | None = None) -> None:
        """Feed the decode pod's measurements with what the client saw after its first token: the
        P→D hand-over (`pd_gap_seconds`, with P/D) into its typical gap, and the TPOT over what the
        model predicts for this many tokens (its step, with the typical gap spread over them:
        `predict.client_tpot`) into its calibration."""
        pod = decision.decode
        if pd_gap_seconds is not None:
            pod.pd_gap.observe(pd_gap_seconds)
        if decision.predicted_tpot_seconds is None or num_tokens <= 1:
            return
        gap = (pod.pd_gap.value or pd_gap_seconds) if pd_gap_seconds is not None else None
        predicted = decision.predicted_tpot_seconds if gap is None else \
            client_tpot(decision.predicted_tpot_seconds, gap, num_tokens)
        pod.tpot_calibration.observe(decode_seconds / (num_tokens - 1), predicted)
        self.metrics.calibration(pod.address, "tpot", pod.tpot_calibration.factor)

    def spawn(self, coro) -> None:
        """Run `coro` in the background (best-effort calls such as Abort)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def is_ready(self) -> bool:
        """A request could be routed now: a colocated pod, or a decode pod with a prefill pod (or
        without one, when decode pods may prefill locally)."""
        pods = self.pods_by_role()
        return bool(pods["colocated"]) or bool(pods["decode"]) and (
            bool(pods["prefill"]) or self.policy.local_prefill_fallback)


def build_dispatcher(config: RouterConfig, metrics: RouterMetrics,
                     clock: Callable[[], float] = time.monotonic) -> Dispatcher:
    """The router's routing core for `config`, wired as the app runs it: load tracker, prefix index,
    admission (re-run on every load report) and policy. The capacity planner builds the same one on
    its virtual clock (`cbserve.planner`)."""
    tracker = LoadTracker(config.load_interval_seconds, config.probe_interval_seconds,
                          close_grace_seconds=config.request_timeout_seconds,
                          pod_inactivity_seconds=config.pod_inactivity_seconds, security=config.security)
    prefix_index = PrefixIndex(config.prefix_affinity_entries)
    admission = AdmissionController(config.admission, config.max_queue_seconds, config.max_queue_size, metrics,
                                    config.startup_wait_seconds, clock=clock)
    tracker.add_listener(admission.wake)
    policy = build_policy(config.policy, prefix_index, config.default_prefill_tokens_per_second,
                          config.local_prefill_fallback)
    return Dispatcher(tracker, policy, admission, prefix_index, metrics, config.max_retries, config.kv_transport,
                      clock=clock)


__all__ = ["Dispatcher", "PodLost", "SequenceSpec", "SequenceStream", "SequenceTrace", "build_dispatcher"]
