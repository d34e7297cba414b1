"""The router's end of a decode pod's `Session`: one stream per pod, fanned out per request.

`DecodeSession` opens `DecodeService.Session` once and keeps it while it works. `generate()` writes
the request on it and returns a `SessionCall` that reads like the per-request stream it replaces:
`read()` returns the request's next `GenerateResponse` or raises `grpc.aio.AioRpcError` with the
status a per-request call would have ended with, and `cancel()` aborts it on the pod. The one
reader task takes each pod message (one per engine step, every request that moved) and puts each
request's part in that request's queue: the per-token cost is a dict lookup and a queue put.

Liveness is per pod, not per token: the pod sends a heartbeat in every second it says nothing else,
and a timer checks, once per `CHECK_SECONDS` while requests are open, that something arrived in
the last `inactivity_seconds`. When nothing did, the pod is frozen: the stream is cancelled and
every open request fails with UNAVAILABLE, which the router treats like a dead pod (retried
elsewhere if no byte reached the client yet).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from wire import cbserve_pb2 as pb

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a per-request call would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class SessionCall:
    """One request on a session: `read()` its messages in order, `cancel()` to abort it."""

    __slots__ = ("_session", "request_id", "_items")

    def __init__(self, session: DecodeSession, request_id: str) -> None:
        self._session = session
        self.request_id = request_id
        self._items: asyncio.Queue = asyncio.Queue()

    async def read(self) -> pb.GenerateResponse:
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._session.cancel(self.request_id)


class DecodeSession:
    """One `Session` stream to the pod behind `stub`; `broken` once it ended (open a new one)."""

    def __init__(self, stub, address: str, inactivity_seconds: float, metadata=None) -> None:
        self.address = address
        self.inactivity_seconds = inactivity_seconds
        self.broken = False
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self._calls: dict[str, SessionCall] = {}
        self._last_heard = self._loop.time()
        self._silence: str | None = None
        self._closing = False
        self.num_messages = 0               # pod messages read (benchmarks: tokens per message)
        self._check: asyncio.TimerHandle | None = None
        self._call = stub.Session(self._requests(), metadata=metadata)   # metadata: the cluster secret
        self._reader = asyncio.ensure_future(self._read())

    # ------------------------------------------------------------------ requests
    def generate(self, request: pb.GenerateRequest, timeout: float) -> SessionCall:
        request.timeout_seconds = timeout
        call = SessionCall(self, request.request_id)
        if request.request_id in self._calls:        # replies are matched by id: never two alike
            call._items.put_nowait(rpc_error(grpc.StatusCode.ALREADY_EXISTS,
                                             f"request {request.request_id!r} is already open on this session"))
            return call
        if not self._calls:
            self._last_heard = self._loop.time()     # silence counts from when there is work
            if self._check is None:
                self._check = self._loop.call_later(CHECK_SECONDS, self._check_heard)
        self._calls[request.request_id] = call
        self._outbox.put_nowait(pb.SessionRequest(generate=request))
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.broken:
            self._outbox.put_nowait(pb.SessionRequest(cancel_request_id=request_id))

    def close(self) -> None:
        """End the session (router shutdown): open requests are cancelled, as by a closed channel."""
        self._closing = True
        self._outbox.put_nowait(None)
        self._call.cancel()

    async def _requests(self):
        while (message := await self._outbox.get()) is not None:
            yield message

    # ------------------------------------------------------------------ responses
    async def _read(self) -> None:
        calls = self._calls
        try:
            async for message in self._call:
                self._last_heard = self._loop.time()
                self.num_messages += 1
                for out in message.outputs:
                    call = calls.get(out.request_id)
                    if call is not None:
                        if out.finished:
                            del calls[out.request_id]
                        call._items.put_nowait(out)
                for error in message.errors:
                    call = calls.pop(error.request_id, None)
                    if call is not None:
                        call._items.put_nowait(rpc_error(_CODES.get(error.code, grpc.StatusCode.UNKNOWN),
                                                         error.message))
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode pod {self.address} ended the session")
        except grpc.aio.AioRpcError as exc:
            failure = exc
            if exc.code() == grpc.StatusCode.CANCELLED and self._silence is not None:
                failure = rpc_error(grpc.StatusCode.UNAVAILABLE, self._silence)
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, self._silence or "session cancelled")
        if self._closing:
            failure = asyncio.CancelledError("the router closed its session with the pod")
        self.broken = True
        if self._check is not None:
            self._check.cancel()
        for call in calls.values():
            call._items.put_nowait(failure)
        calls.clear()

    def _check_heard(self) -> None:
        self._check = None
        if self.broken:
            return
        silent = self._loop.time() - self._last_heard
        if self._calls and silent > self.inactivity_seconds:
            self._silence = (f"decode pod {self.address} sent nothing for {silent:.1f}s "
                             f"(limit {self.inactivity_seconds:g}s): frozen or unreachable")
            log.warning("%s", self._silence)
            self._call.cancel()
            return
        if self._calls:
            self._check = self._loop.call_later(CHECK_SECONDS, self._check_heard)
