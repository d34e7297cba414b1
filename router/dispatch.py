"""Running one output sequence on the pods: admit, call, merge, deduplicate, retry, cancel.

Disaggregated: `Prefill` on P and `Generate(prefill_from=P)` on D start together. P's answer carries
the first token, streamed to the client at once; D's stream repeats it (index 0) and continues, so
tokens are deduplicated by `GenerateResponse.index`. Colocated: only `Generate`, empty
`prefill_from`. Every call carries the request's deadline as its gRPC timeout.

Failures: a call that fails before the client has seen any token is retried on other pods (the
failed pod is excluded and, for connection-level errors, taken out of routing until a probe
succeeds). After the first token the request fails with an error the client sees. When the
consumer stops early (client disconnect, stop string found by the router), both calls are
cancelled, which frees their state on the pods, and a best-effort `Abort` follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from cbserve.pb import cbserve_pb2 as pb
from engine.sampling_params import SamplingParams, to_proto
from router.admission import AdmissionController
from router.errors import timeout_error, unavailable, upstream_error
from router.load import LoadTracker, PodState
from router.metrics import RouterMetrics
from router.policy import NoRoute, Policy, PrefixIndex, RoutingDecision, RoutingRequest

log = logging.getLogger(__name__)

# Connection-level failures: the pod is taken out of routing. Others only exclude it for this request.
_POD_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.DATA_LOSS}
_NOT_RETRYABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@dataclass(frozen=True)
class SequenceSpec:
    """One output sequence to generate (a request with n=2 has two)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    routing: RoutingRequest
    arrival_time: float          # unix seconds at the router
    deadline: float              # monotonic seconds; every RPC's timeout counts down to it
    priority: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens; `index` is the output position of token_ids[0]."""

    index: int
    token_ids: list[int]
    logprobs: list[pb.TokenLogprobs]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class SequenceTrace:
    """What happened to one sequence, for metrics and for explaining a slow request."""

    router_queue_seconds: float = 0.0
    prefill_queue_seconds: float | None = None
    prefill_seconds: float | None = None
    kv_transfer_seconds: float | None = None
    decode_queue_seconds: float | None = None
    num_cached_tokens: int = 0
    local_prefill: bool = False
    attempts: list[str] = field(default_factory=list)   # "P@addr+D@addr" per attempt


class _AttemptFailed(Exception):
    def __init__(self, pod: PodState, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{pod.role} pod {pod.address}: {code.name} {details}")
        self.pod = pod
        self.code = code
        self.details = details


def with_ttft_budget_left(routing: RoutingRequest, waited_seconds: float) -> RoutingRequest:
    """The request as a routing attempt after `waited_seconds` in the router's queue: its TTFT SLO
    shrinks by the wait, because the client's TTFT counts it. A request that waited most of its
    SLO is admitted only where it still fits (or to an idle pod), not where a fresh one would."""
    if waited_seconds <= 0:
        return routing
    return replace(routing, slo_ttft_seconds=max(1e-3, routing.slo_ttft_seconds - waited_seconds))


class Dispatcher:
    """Routes sequences with the policy and admission control, and runs them on the pods."""

    def __init__(self, tracker: LoadTracker, policy: Policy, admission: AdmissionController,
                 prefix_index: PrefixIndex, metrics: RouterMetrics, max_retries: int = 2,
                 kv_transport: str = "") -> None:
        self.tracker = tracker
        self.policy = policy
        self.admission = admission
        self.prefix_index = prefix_index
        self.metrics = metrics
        self.max_retries = max_retries
        self.kv_transport = kv_transport
        self._background: set[asyncio.Task] = set()

    def pods_by_role(self) -> dict[str, list[PodState]]:
        return {role: self.tracker.routable(role) for role in ("prefill", "decode", "colocated")}

    def _try_route(self, routing: RoutingRequest) -> RoutingDecision | NoRoute:
        """Route and, on success, reserve the pods at once (in-flight accounting, prefix index)."""
        decision = self.policy.route(routing, self.pods_by_role())
        if isinstance(decision, RoutingDecision):
            first = decision.prefill or decision.decode
            first.on_dispatch(routing.num_prompt_tokens)
            if decision.prefill is not None:
                decision.decode.on_dispatch(routing.num_prompt_tokens)
            self.prefix_index.record(routing.block_hashes, first.address)
            self.metrics.running.inc()
        return decision

    def _release(self, decision: RoutingDecision) -> None:
        for pod in {decision.prefill, decision.decode} - {None}:
            pod.on_finish()
        self.metrics.running.dec()
        self.admission.wake()

    async def run(self, spec: SequenceSpec, trace: SequenceTrace) -> AsyncIterator[TokenEvent]:
        """Tokens of one sequence. Raises APIError before the first token if it cannot be served."""
        start = time.monotonic()
        decision = await self.admission.admit(
            lambda: self._try_route(with_ttft_budget_left(spec.routing, time.monotonic() - start)),
            spec.deadline, self._release, slo_wait_seconds=spec.routing.slo_ttft_seconds)
        trace.router_queue_seconds = time.monotonic() - start
        self.metrics.observe_phase("router_queue", trace.router_queue_seconds)
        routing = spec.routing
        attempt = 0
        while True:
            emitted = [False]
            try:
                async for event in self._attempt(spec, decision, attempt, trace, emitted):
                    yield event
                return
            except _AttemptFailed as failed:
                code = failed.code
                if code in _POD_DOWN:
                    self.tracker.mark_failed(failed.pod, f"{code.name}: {failed.details}")
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise timeout_error("The request's deadline passed before it finished.") from None
                if emitted[0] or code in _NOT_RETRYABLE or attempt >= self.max_retries:
                    raise upstream_error(f"Generation failed: {failed}") from None
                log.warning("request %s: %s; retrying on another pod", spec.request_id, failed)
                self.metrics.retries.inc()
                # Admission already accepted this request: a retry goes to any other pod, SLO or not.
                routing = replace(routing, exclude=routing.exclude | {failed.pod.address},
                                  slo_ttft_seconds=float("inf"), slo_tpot_seconds=float("inf"))
                decision = self._try_route(routing)
                if isinstance(decision, NoRoute):
                    raise unavailable(f"Generation failed and no other pod is ready: {failed}") from None
                attempt += 1

    async def _attempt(self, spec: SequenceSpec, decision: RoutingDecision, attempt: int,
                       trace: SequenceTrace, emitted: list[bool]) -> AsyncIterator[TokenEvent]:
        """One try on one (P, D) pair; yields deduplicated token events."""
        request_id = spec.request_id if attempt == 0 else f"{spec.request_id}-retry{attempt}"
        prefill_pod, decode_pod = decision.prefill, decision.decode
        routed_at = time.monotonic()
        trace.attempts.append(f"P@{prefill_pod.address}+D@{decode_pod.address}" if prefill_pod
                              else f"C@{decode_pod.address}")
        sampling = to_proto(spec.params)
        timeout = max(0.001, spec.deadline - time.monotonic())
        gen_call = decode_pod.client.generate(pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
            priority=spec.priority, prefill_from=prefill_pod.address if prefill_pod else "",
            kv_transport=self.kv_transport if prefill_pod else "", arrival_time=spec.arrival_time),
            timeout=timeout)
        prefill_call = None
        if prefill_pod is not None:
            prefill_call = prefill_pod.client.prefill(pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
                priority=spec.priority, arrival_time=spec.arrival_time), timeout=timeout)
        inbox: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump_generate(gen_call, inbox))]
        if prefill_call is not None:
            pumps.append(asyncio.create_task(self._pump_prefill(prefill_call, inbox)))
        finished = False
        finished_by_prefill = False    # the first token ended it: D's call is cut short
        prefill_failure: grpc.aio.AioRpcError | None = None
        next_index = 0
        first_token_at: float | None = None   # monotonic; for the pod's TPOT calibration
        try:
            while True:
                kind, item = await inbox.get()
                if kind == "prefill_error":
                    # D pulls the KV from P; with P gone, D prefills locally or fails on its own.
                    prefill_failure = item
                    if item.code() in _POD_DOWN:
                        self.tracker.mark_failed(prefill_pod, f"Prefill: {item.code().name}")
                    continue
                if kind == "gen_error":
                    if prefill_failure is not None and prefill_failure.code() in _POD_DOWN:
                        # D failed because its source died (no local fallback): P's fault, not D's.
                        raise _AttemptFailed(prefill_pod, prefill_failure.code(),
                                             f"{prefill_failure.details()}; decode: {item.details()}")
                    raise _AttemptFailed(decode_pod, item.code(), item.details() or "")
                if kind == "gen_end":
                    if not finished:
                        raise upstream_error(f"decode pod {decode_pod.address} ended the stream early")
                    return
                if kind == "prefill":
                    trace.prefill_queue_seconds = item.queue_seconds
                    trace.prefill_seconds = item.prefill_seconds
                    trace.num_cached_tokens = item.num_cached_tokens
                    event = TokenEvent(0, [item.first_token_id], [item.first_token_logprobs],
                                       item.finished, item.finish_reason or None)
                    finished_by_prefill = item.finished and next_index == 0
                else:
                    if item.finished and item.finish_reason == "abort":
                        # The pod gave the request up (draining, out of room): like a failed call.
                        raise _AttemptFailed(decode_pod, grpc.StatusCode.ABORTED, "the pod aborted the request")
                    if item.index == 0 and item.token_ids:
                        self._record_generate_trace(item, trace)
                    event = TokenEvent(item.index, list(item.token_ids), list(item.logprobs),
                                       item.finished, item.finish_reason or None)
                # Deduplicate: keep only tokens at positions not yet emitted.
                if event.index > next_index:
                    raise upstream_error(f"token gap from pods: got index {event.index}, expected {next_index}")
                skip = next_index - event.index
                if skip >= len(event.token_ids) and not event.finished:
                    continue
                event = replace(event, index=next_index, token_ids=event.token_ids[skip:],
                                logprobs=event.logprobs[skip:])
                next_index += len(event.token_ids)
                emitted[0] = emitted[0] or bool(event.token_ids)
                if first_token_at is None and event.token_ids:
                    first_token_at = time.monotonic()
                    self._observe_ttft(decision, first_token_at - routed_at)
                finished = event.finished
                if finished and first_token_at is not None:
                    # Before the yield: a consumer that stops at the last token never resumes us.
                    self._observe_tpot(decision, time.monotonic() - first_token_at, next_index)
                yield event
                if finished:
                    return
        finally:
            for pump in pumps:
                pump.cancel()
            gen_call.cancel()
            if prefill_call is not None:
                prefill_call.cancel()
            if not finished or finished_by_prefill:
                # Cut short: make sure neither pod keeps state (P may hold the KV for a pull).
                for pod in (prefill_pod, decode_pod):
                    if pod is not None:
                        self._spawn(pod.client.abort(request_id))
            self._release(decision)

    def _observe_ttft(self, decision: RoutingDecision, ttft_seconds: float) -> None:
        """Feed the prefilling pod's TTFT calibration: routing to first token, measured here."""
        if decision.predicted_ttft_seconds is not None:
            pod = decision.prefill or decision.decode
            pod.ttft_calibration.observe(ttft_seconds, decision.predicted_ttft_seconds)
            self.metrics.calibration(pod.address, "ttft", pod.ttft_calibration.factor)

    def _observe_tpot(self, decision: RoutingDecision, decode_seconds: float, num_tokens: int) -> None:
        """Feed the decode pod's calibration with the TPOT measured here, as the client sees it."""
        if decision.predicted_tpot_seconds is not None and num_tokens > 1:
            pod = decision.decode
            pod.tpot_calibration.observe(decode_seconds / (num_tokens - 1), decision.predicted_tpot_seconds)
            self.metrics.calibration(pod.address, "tpot", pod.tpot_calibration.factor)

    @staticmethod
    def _record_generate_trace(item: pb.GenerateResponse, trace: SequenceTrace) -> None:
        trace.local_prefill = item.local_prefill
        if item.local_prefill:
            trace.prefill_queue_seconds = item.queue_seconds
            trace.num_cached_tokens = item.num_cached_tokens
        else:
            trace.kv_transfer_seconds = item.kv_transfer_seconds
            trace.decode_queue_seconds = item.queue_seconds

    @staticmethod
    async def _pump_prefill(call: grpc.aio.UnaryUnaryCall, inbox: asyncio.Queue) -> None:
        try:
            inbox.put_nowait(("prefill", await call))
        except grpc.aio.AioRpcError as exc:
            inbox.put_nowait(("prefill_error", exc))

    @staticmethod
    async def _pump_generate(call: grpc.aio.UnaryStreamCall, inbox: asyncio.Queue) -> None:
        try:
            async for response in call:
                inbox.put_nowait(("gen", response))
            inbox.put_nowait(("gen_end", None))
        except grpc.aio.AioRpcError as exc:
            inbox.put_nowait(("gen_error", exc))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def is_ready(self) -> bool:
        """A request could be routed now: a colocated pod, or a prefill and a decode pod."""
        pods = self.pods_by_role()
        return bool(pods["colocated"]) or bool(pods["prefill"] and pods["decode"])


__all__ = ["Dispatcher", "SequenceSpec", "SequenceTrace", "TokenEvent"]
