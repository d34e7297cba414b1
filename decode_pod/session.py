"""A decode pod's `Session`: many requests on one stream, one message per engine step.

The router keeps one Session open per decode pod. Requests and cancels arrive on it; each step
message from the engine core is fanned out to its requests in one event-loop wake
(`Subscribers.subscribe_with`), and the session answers with one `SessionResponse` holding a `GenerateResponse` for every request
that moved. So a step of a 64-request batch costs one wake and one gRPC message, where per-request
streams cost 64 of each (the send was about three quarters of the pod's loop-thread CPU per token).
When the reader is slow, the steps queued meanwhile go out together in the next message.

The pod also sends an empty message every `HEARTBEAT_SECONDS` in which it sent nothing else: a
router that hears nothing for several heartbeats knows the pod (not just a request) is stuck.
Closing the stream, from either side, closes every request still open on it (their KV is freed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from wire import cbserve_pb2
from decode_pod.open_request import OpenRequest
from pod.runtime import RequestFailed, refused

HEARTBEAT_SECONDS = 1.0
# `DecodeServicer.open`: validate and register one request, queue it in the engine core (raises
# RequestFailed). Passed in, so this module needs nothing from the servicer's.
OpenRequestFn = Callable[[cbserve_pb2.GenerateRequest, float, Callable[[object], None]],
                         tuple[OpenRequest, concurrent.futures.Future]]


class Session:
    def __init__(self, open_request: OpenRequestFn) -> None:
        self._open_request = open_request
        self._open: dict[str, OpenRequest] = {}
        self._pending: dict[str, list] = {}          # request id -> outputs/failures since the last message
        self._refusals: list[cbserve_pb2.RequestError] = []
        self._wake = asyncio.Event()
        self._reading_done = False
        self._sent_since_tick = True
        self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ inbound
    def _put(self, request_id: str, item: object) -> None:
        items = self._pending.get(request_id)
        if items is None:
            self._pending[request_id] = [item]
        else:
            items.append(item)
        self._wake.set()

    def _refuse(self, request_id: str, error: RequestFailed) -> None:
        self._refusals.append(cbserve_pb2.RequestError(request_id=request_id, code=error.code.value[0],
                                                        message=str(error)))
        self._wake.set()

    def _generate(self, request: cbserve_pb2.GenerateRequest) -> None:
        req_id = request.request_id
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 3600.0
        try:
            req, added = self._open_request(request, timeout, lambda item: self._put(req_id, item))
        except RequestFailed as e:
            self._refuse(req_id, e)
            return
        self._open[req_id] = req

        def on_added(future) -> None:        # engine thread
            error = future.exception()
            if error is not None:
                self._loop.call_soon_threadsafe(self._put, req_id, refused(error))
        added.add_done_callback(on_added)

    def _cancel(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        req = self._open.pop(request_id, None)
        if req is not None:
            req.close()

    async def _read(self, request_iterator) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "generate":
                    self._generate(message.generate)
                elif kind == "cancel_request_id":
                    self._cancel(message.cancel_request_id)
        finally:
            self._reading_done = True
            self._wake.set()

    # ------------------------------------------------------------------ outbound
    def _tick(self) -> None:
        if not self._sent_since_tick:
            self._wake.set()            # nothing went out for a whole period: send a heartbeat
        self._sent_since_tick = False
        self._timer = self._loop.call_later(HEARTBEAT_SECONDS, self._tick)

    def _collect(self) -> cbserve_pb2.SessionResponse:
        message = cbserve_pb2.SessionResponse()
        pending, self._pending = self._pending, {}
        for req_id, items in pending.items():
            req = self._open.get(req_id)
            if req is None:
                continue
            error = req.respond(items, new=message.outputs.add)[1]
            if error is not None:
                code, text = req.failed(error)
                message.errors.add(request_id=req_id, code=code.value[0], message=text)
            if req.finished or error is not None:
                del self._open[req_id]
                req.close()
        if self._refusals:
            message.errors.extend(self._refusals)
            self._refusals = []
        return message

    async def run(self, request_iterator):
        """The Session handler's messages, until the router closes its side and nothing is open."""
        reader = asyncio.ensure_future(self._read(request_iterator))
        self._timer = self._loop.call_later(HEARTBEAT_SECONDS, self._tick)
        try:
            yield cbserve_pb2.SessionResponse(heartbeat_seconds=HEARTBEAT_SECONDS)
            while not (self._reading_done and not self._open):
                await self._wake.wait()
                self._wake.clear()
                message = self._collect()
                if message.outputs or message.errors or not self._sent_since_tick:
                    self._sent_since_tick = True
                    yield message
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()   # an undecodable frame ends the session with an error, not OK
        finally:
            self._timer.cancel()
            reader.cancel()
            for req in self._open.values():
                req.close()
            self._open.clear()
