"""The pod calls of one attempt at one sequence, read as a stream of deduplicated token messages.

Disaggregated: `Prefill` on P and `Generate(prefill_from=P)` on D start together (D's request
travels on the router's `Session` with D: `router.pod_session`). P's answer carries the first
token; D's stream repeats it (index 0) and continues. Until the first tokens arrive the two are
raced (`first()`); after that D's `SessionCall` is read directly, one `GenerateResponse` per pod
message (a pod sends one message per engine step for all its requests; the session's reader puts
each request's part in its queue): the per-message work here is one read, an index comparison
and, rarely, a trimmed copy of a message that repeats tokens already given.

`close()` ends the attempt: it cancels both calls (which frees their state on the pods), sends a
best-effort `Abort` if the sequence did not finish normally, and returns the pods' in-flight slots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Protocol

import grpc

from wire import cbserve_pb2 as pb
from engine.sampling.params import to_proto
from router.errors import APIError, upstream_error
from router.sequence import SequenceSpec, SequenceTrace
from router.structured.handoff import FirstTokenHandoff

if TYPE_CHECKING:
    from router.load import LoadTracker, PodState
    from router.policy import RoutingDecision

# Connection-level failures: the pod is taken out of routing. Others only exclude it for this request.
POD_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                      grpc.StatusCode.DATA_LOSS})


class AttemptOwner(Protocol):
    """What an attempt needs from whoever routed it (`router.dispatch.Dispatcher`): where failures,
    measurements and finished attempts go."""

    kv_transport: str
    tracker: LoadTracker

    def failure_error(self, failed: PodFailure, retry: bool) -> APIError | None: ...
    def observe_ttft(self, decision: RoutingDecision, ttft_seconds: float) -> None: ...
    def observe_tpot(self, decision: RoutingDecision, decode_seconds: float, num_tokens: int,
                     pd_gap_seconds: float | None = None) -> None: ...
    def spawn(self, coro: Coroutine) -> None: ...
    def prefill_answered(self, decision: RoutingDecision) -> None: ...
    def release(self, decision: RoutingDecision, answered: bool = False) -> None: ...


class PodFailure(Exception):
    """A call of the attempt failed; `pod` is the pod to blame."""

    def __init__(self, pod: PodState, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{pod.role} pod {pod.address}: {code.name} {details}")
        self.pod = pod
        self.code = code
        self.details = details


class SequenceStream:
    """One try on one (P, D) pair. After `first()`, `first_message` holds the first tokens and each
    `next()` returns the next message with new tokens, until one has `finished` set."""

    def __init__(self, dispatcher: AttemptOwner, spec: SequenceSpec, decision: RoutingDecision, attempt: int,
                 trace: SequenceTrace) -> None:
        self._dispatcher = dispatcher
        self._decision = decision
        self._trace = trace
        self.request_id = spec.request_id if attempt == 0 else f"{spec.request_id}-retry{attempt}"
        self.prefill_pod, self.decode_pod = decision.prefill, decision.decode
        self._routed_at = time.monotonic()
        trace.attempts.append(f"P@{self.prefill_pod.address}+D@{self.decode_pod.address}" if self.prefill_pod
                              else f"C@{self.decode_pod.address}")
        sampling = to_proto(spec.params)
        timeout = max(0.001, spec.deadline - time.monotonic())
        pd = self.prefill_pod is not None
        self._gen_call = self.decode_pod.client.generate(pb.GenerateRequest(
            request_id=self.request_id, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
            priority=spec.priority, prefill_from=self.prefill_pod.address if pd else "",
            kv_transport=dispatcher.kv_transport if pd else "", arrival_time=spec.arrival_time,
            lora_name=spec.lora_name), timeout=timeout)
        self._prefill_call = None
        self._prefill: asyncio.Future | None = None     # P's answer, until first() has looked at it
        self._answered = False               # P's call ended while the attempt went on
        if pd:
            self._prefill_call = self.prefill_pod.client.prefill(pb.PrefillRequest(
                request_id=self.request_id, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
                priority=spec.priority, arrival_time=spec.arrival_time, lora_name=spec.lora_name), timeout=timeout)
            self._prefill = asyncio.ensure_future(self._prefill_call)
            self._prefill.add_done_callback(self._prefill_over)
        self._read: asyncio.Future | None = None        # a read of D's stream started while racing P
        self._prefill_failure: grpc.aio.AioRpcError | None = None
        self.first_message: pb.GenerateResponse | None = None
        self.next_index = 0                  # output position of the next new token
        self.finished = False
        self._finished_by_prefill = False    # P's token ended it: D's call is cut short
        self.first_token_at: float | None = None     # monotonic; when the first tokens arrived
        self._gap_from: float | None = None  # when P's first token came, until D's first new token
        self._closed = False
        # Constrained: P's token is given out only if P sampled it under the grammar, and D's
        # index 0 must then be the same token (router/structured/handoff.py).
        self._handoff = FirstTokenHandoff() if spec.params.structured is not None else None

    async def first(self) -> pb.GenerateResponse:
        """The first message with tokens (or the finished one): P's answer or D's, whichever comes
        first. Raises PodFailure if the attempt fails before it (the caller may retry elsewhere)."""
        while True:
            if self._read is None:
                self._read = asyncio.ensure_future(self._gen_call.read())
            racing = (self._read,) if self._prefill is None else (self._read, self._prefill)
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            message = None
            if self._prefill is not None and self._prefill.done():
                prefill, self._prefill = self._prefill, None
                message = self._on_prefill(prefill)
            if message is None and self._read.done():
                read, self._read = self._read, None
                message = self._accept(self._result(_outcome(read)))
            if message is not None:
                if self._prefill is not None:
                    # D spoke first: P's answer only repeats token 0; keep its trace and its failure.
                    self._prefill.add_done_callback(self._on_prefill)
                    self._prefill = None
                self.first_message = message
                return message

    async def next(self) -> pb.GenerateResponse:
        """The next message with new tokens; raises APIError if the calls fail (too late to retry)."""
        while True:
            if self._read is not None:
                read, self._read = self._read, None
                response = _outcome(read) if read.done() else await _settled(read)
            else:
                try:
                    response = await self._gen_call.read()
                except grpc.aio.AioRpcError as exc:
                    response = exc
            try:
                message = self._accept(self._result(response))
            except PodFailure as failed:
                raise self._dispatcher.failure_error(failed, retry=False) from None
            if message is not None:
                return message

    @property
    def _measures_the_pods(self) -> bool:
        """The attempt ran as routed, so its latencies calibrate the pods' predictions. Not when
        its prefill pod failed and the decode pod prefilled locally: that TTFT and that TPOT hold
        the failure (seconds of keepalive or a dead connection), and charged to the healthy decode
        pod, or to the prefill pod once it is back, they would make it look slow long after."""
        return self._prefill_failure is None and not (self.prefill_pod is not None and self._trace.local_prefill)

    def _result(self, response: pb.GenerateResponse | BaseException) -> pb.GenerateResponse:
        """D's message, or the failure it stands for."""
        if isinstance(response, pb.GenerateResponse):
            return response
        if response is grpc.aio.EOF:
            raise upstream_error(f"decode pod {self.decode_pod.address} ended the stream early")
        if not isinstance(response, grpc.aio.AioRpcError):
            raise response
        source = self._prefill_failure
        if source is not None and source.code() in POD_DOWN:
            # D failed because its source died (no local fallback): P's fault, not D's.
            raise PodFailure(self.prefill_pod, source.code(), f"{source.details()}; decode: {response.details()}")
        raise PodFailure(self.decode_pod, response.code(), response.details() or "")

    def _prefill_over(self, prefill: asyncio.Future) -> None:
        """P's call ended (answered or failed) before the attempt did: P is done with it."""
        if not self._closed and not prefill.cancelled():
            self._answered = True
            self._dispatcher.prefill_answered(self._decision)

    def _on_prefill(self, prefill: asyncio.Future) -> pb.GenerateResponse | None:
        """P answered: record its trace; its token as a message, or None (P failed, D goes on alone)."""
        if prefill.cancelled():
            return None
        failure = prefill.exception()
        if failure is not None:
            if not isinstance(failure, grpc.aio.AioRpcError):
                raise failure
            # D pulls the KV from P; with P gone, D prefills locally or fails on its own.
            self._prefill_failure = failure
            if failure.code() in POD_DOWN:
                self._dispatcher.tracker.mark_failed(self.prefill_pod, f"Prefill: {failure.code().name}")
            return None
        answer: pb.PrefillResponse = prefill.result()
        trace = self._trace
        trace.prefill_queue_seconds = answer.queue_seconds
        trace.prefill_seconds = answer.prefill_seconds
        trace.num_cached_tokens = answer.num_cached_tokens
        if self.first_message is not None or (self._handoff is not None and not self._handoff.from_prefill(answer)):
            return None
        self._finished_by_prefill = answer.finished and self.next_index == 0
        message = pb.GenerateResponse(
            index=0, token_ids=[answer.first_token_id], logprobs=[answer.first_token_logprobs],
            finished=answer.finished, finish_reason=answer.finish_reason)
        if answer.HasField("prompt_logprobs"):
            message.prompt_logprobs.CopyFrom(answer.prompt_logprobs)
        return self._accept(message, from_prefill=True)

    def _accept(self, message: pb.GenerateResponse, from_prefill: bool = False) -> pb.GenerateResponse | None:
        """Deduplicate by index: the message with only tokens not given yet, or None if it has none."""
        index, count, finished = message.index, len(message.token_ids), message.finished
        if not from_prefill:
            if index == 0 and count:
                self._trace.record_generate(message)
            if finished and message.finish_reason == "abort":
                # The pod gave the request up (draining, out of room): like a failed call.
                raise PodFailure(self.decode_pod, grpc.StatusCode.ABORTED, "the pod aborted the request")
            if self._handoff is not None:
                self._handoff.check_decode(message)
        if index != self.next_index:
            if index > self.next_index:
                raise upstream_error(f"token gap from pods: got index {index}, expected {self.next_index}")
            skip = self.next_index - index
            if skip >= count and not finished:
                return None
            message = pb.GenerateResponse(
                index=self.next_index, token_ids=message.token_ids[skip:], logprobs=message.logprobs[skip:],
                finished=finished, finish_reason=message.finish_reason)
            count = max(0, count - skip)
        elif not count and not finished:
            return None
        if count:
            self.next_index += count
            if self.first_token_at is None:
                self.first_token_at = now = time.monotonic()
                if self._measures_the_pods:
                    self._dispatcher.observe_ttft(self._decision, now - self._routed_at)
                if from_prefill and not finished:
                    self._gap_from = now
            elif self._gap_from is not None:      # D's first new token after P's
                self._trace.pd_gap_seconds = time.monotonic() - self._gap_from
                self._gap_from = None
        if finished:
            self.finished = True
            if self.first_token_at is not None and self._measures_the_pods:
                self._dispatcher.observe_tpot(self._decision, time.monotonic() - self.first_token_at,
                                              self.next_index, self._trace.pd_gap_seconds)
            self.close()
        return message

    def close(self) -> None:
        """End the attempt: cancel both calls, abort what did not finish, release the pods. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for future in (self._read, self._prefill):
            if future is not None:
                if future.done() and not future.cancelled():
                    future.exception()       # looked at: no "exception was never retrieved" log
                future.cancel()
        self._gen_call.cancel()
        if self._prefill_call is not None:
            self._prefill_call.cancel()
        if not self.finished or self._finished_by_prefill:
            # Cut short: make sure neither pod keeps state (P may hold the KV for a pull).
            for pod in (self.prefill_pod, self.decode_pod):
                if pod is not None:
                    self._dispatcher.spawn(pod.client.abort(self.request_id))
        self._dispatcher.release(self._decision, self._answered)


def _outcome(future: asyncio.Future) -> pb.GenerateResponse | BaseException:
    """A finished read's message, or the exception it raised."""
    exc = future.exception()
    return future.result() if exc is None else exc


async def _settled(future: asyncio.Future) -> pb.GenerateResponse | BaseException:
    """A pending read's message, or the gRPC error it raised."""
    try:
        return await future
    except grpc.aio.AioRpcError as exc:
        return exc
