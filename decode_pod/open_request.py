"""One request's life on a decode pod, shared by the per-request `Generate` call and the `Session`.

`OpenRequest` (server process) registers the request (its `Job`, its subscription to the engine
core's outputs, its deadline timer), turns whatever the engine core sent for it since the last
message (`CoreOutput`s) into one `GenerateResponse` (`respond`), records the pod's request metrics,
and on `close` undoes all of it: an unfinished request is aborted in the engine core, which ends
its pull (freeing the prefill pod's blocks) and frees its own. Who calls `respond` and where the message goes is the caller's:
a `Generate` handler yields it on its own stream; a `Session` packs the messages of every request
that moved in one engine step into one `SessionResponse`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from wire import cbserve_pb2
from engine.grammar.spec import StructuredSpec
from pod.core_client import CoreRuntime
from pod.runtime import RequestFailed


@dataclass
class Job:
    """A request on this pod: the server's record, and the engine core's (which pulls its KV)."""
    prefill_from: str
    transport: str
    deadline: float                     # monotonic
    arrival: float = field(default_factory=time.monotonic)
    local_prefill: bool = False
    kv_transfer_seconds: float = 0.0
    kv_pulled_at: float | None = None   # monotonic: the pull ended, the first token is known
    task: asyncio.Task | None = None
    kv_handle: cbserve_pb2.KVHandle | None = None   # the router's voucher, forwarded to the prefill pod
    kv_bytes: int = 0
    draft_kv_shipped: bool = False      # the draft model's KV came with the target's (kvtransfer.draft_kv)
    reported: bool = False              # engine core: how the KV got here went out with the first output
    structured: StructuredSpec | None = None   # engine core: its grammar (checked at the KV's landing)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class JobRegistry(Protocol):
    """What an open request needs from the pod's servicer (`decode_pod.server.DecodeServicer`):
    the runtime, and the jobs by request id it registers itself in."""

    rt: CoreRuntime
    jobs: dict[str, Job]


class DeadlineExceeded(RequestFailed):
    """Queued by a request's deadline timer: ends the request as a timeout."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, "generation did not finish before the deadline")


class OpenRequest:
    """A request admitted to this pod: `start` it, feed `respond` its queued outputs until
    `finished` (or an error), then `close` it exactly once."""

    def __init__(self, servicer: JobRegistry, request: cbserve_pb2.GenerateRequest, timeout: float,
                 deliver: Callable[[object], None]) -> None:
        rt = self.rt = servicer.rt
        self.servicer = servicer
        self.request_id = req_id = request.request_id
        if req_id in servicer.jobs:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already here")
        self.job = servicer.jobs[req_id] = Job(request.prefill_from, request.kv_transport or "grpc",
                                               time.monotonic() + timeout)
        self.job.local_prefill = not request.prefill_from
        rt.loop.subscribe_with(req_id, deliver)
        self._deadline = asyncio.get_running_loop().call_later(timeout, deliver, DeadlineExceeded())
        rt.num_inflight += 1                    # counted for the drain, like `rt.track()`
        self.index = 0                          # output position of the next token
        self.num_prompt_tokens = 0              # from the first output
        self.finished = False
        self.finish_reason = ""
        self._first_token_at: float | None = None
        self._closed = False

    def start(self, prompt, params, request: cbserve_pb2.GenerateRequest):
        """Queue the request in the engine core; a refusal comes back as the request's failure."""
        return self.rt.loop.add(request, self.job.remaining())

    def respond(self, items: list, new=cbserve_pb2.GenerateResponse,
                ) -> tuple[cbserve_pb2.GenerateResponse | None, BaseException | None]:
        """Everything queued since the last call, as one message made by `new(**fields)` (a
        session passes its response's `outputs.add`, so nothing is copied), or None if no token
        came; and the failure that ends the request (None if it goes on)."""
        token_ids, logprobs, first, last, error = [], [], None, None, None
        for item in items:   # CoreOutputs, or the exception that ends the request
            if isinstance(item, BaseException):
                error = item
                break
            token_ids += item.new_token_ids
            logprobs += item.new_logprobs
            if first is None:
                first = item
            last = item
            if item.finished:
                break
        if last is None:
            return None, error
        job, metrics = self.job, self.rt.metrics
        response = new(
            request_id=self.request_id, index=self.index, token_ids=token_ids, finished=last.finished,
            finish_reason=last.finish_reason, num_prompt_tokens=self.num_prompt_tokens, logprobs=logprobs)
        now = time.monotonic()
        if self.index == 0:
            self._first_token_at = now
            self._arrived(first)
            response.num_prompt_tokens = self.num_prompt_tokens = first.num_prompt_tokens
            metrics.ttft.observe(now - job.arrival)
            response.local_prefill = job.local_prefill
            response.kv_transfer_seconds = job.kv_transfer_seconds
            response.num_cached_tokens = first.num_cached_tokens
            response.draft_kv_shipped = first.draft_kv_shipped
            if first.HasField("prompt_logprobs"):
                response.prompt_logprobs.CopyFrom(first.prompt_logprobs)
        if job.kv_pulled_at is not None and self.index <= 1 < self.index + len(token_ids):
            metrics.decode_first_step.observe(now - job.kv_pulled_at)
        self.index += len(token_ids)
        if last.finished:
            self.finished = True
            self.finish_reason = last.finish_reason or "stop"
            metrics.e2e.observe(now - job.arrival)
            if self.index > 1 and self._first_token_at is not None:
                metrics.tpot.observe((now - self._first_token_at) / (self.index - 1))
            metrics.request_finished(self.finish_reason)
        return response, (None if last.finished else error)

    def _arrived(self, first) -> None:
        """The first output says how the KV got here: record it."""
        job, metrics = self.job, self.rt.metrics
        job.local_prefill = first.local_prefill
        if first.kv_pulled_at > 0:
            job.kv_pulled_at, job.kv_transfer_seconds = first.kv_pulled_at, first.kv_transfer_seconds
            metrics.kv_transfer.observe(first.kv_transfer_seconds)
            metrics.kv_bytes.inc(first.kv_bytes)
        elif job.prefill_from and first.local_prefill:
            metrics.local_prefill_fallbacks.inc()

    def failed(self, error: BaseException) -> tuple[grpc.StatusCode, str]:
        """Record a failure that ends the request; the status and message its caller gets."""
        self.rt.metrics.request_finished("timeout" if isinstance(error, DeadlineExceeded) else "error")
        code = error.code if isinstance(error, RequestFailed) else grpc.StatusCode.INTERNAL
        return code, str(error)

    def close(self) -> None:
        """Release everything the request holds on this pod (idempotent; safe while cancelled)."""
        if self._closed:
            return
        self._closed = True
        rt, req_id, job = self.rt, self.request_id, self.job
        self._deadline.cancel()
        rt.loop.unsubscribe(req_id)
        if self.servicer.jobs.get(req_id) is job:
            del self.servicer.jobs[req_id]
        if not self.finished:
            rt.loop.abort(req_id)   # also ends its PullKV stream: the prefill pod frees its blocks
        rt.num_inflight -= 1
