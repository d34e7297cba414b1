"""The decode pod: `Engine(role="decode")` behind `DecodeService`.

Two processes: this one serves gRPC (Sessions, per-request bookkeeping, metrics, health); the
engine, its thread and the KV pulls run in an engine-core process (`decode_pod.core`, reached
through `pod.core_client`), so nothing here can hold the engine's GIL.

`Generate(req, prefill_from=P)` queues the request until the engine has reserved blocks for its
prompt (nothing is pulled into a pod that has not made room), then pulls the KV from P over the
open `PullKV` stream, writes it into the reserved blocks, and admits the request into the running
batch with the first token P sampled. If P is unreachable or its stream breaks, the pod prefills
the prompt itself when it has headroom (same tokens: seeded sampling is positional), else it fails
fast with UNAVAILABLE. Bad KV (checksum, layout) fails the request; it never yields tokens.
With `prefill_from` empty the pod prefills locally: that is the colocated engine.

A stream costs the event loop one wake and one message per engine step at most: the handler
takes everything queued for its request at once (fewer, larger messages when the client is slow),
and one timer per stream, not one per token, enforces the deadline.
"""

from __future__ import annotations

import asyncio
import logging

from wire import cbserve_pb2, cbserve_pb2_grpc
from engine.loop import drain
from pod.core_client import CoreRuntime
from decode_pod.open_request import Job, OpenRequest
from decode_pod.session import Session
from pod.runtime import CommonRPCs, RequestFailed, refused

log = logging.getLogger(__name__)
SERVICE_NAME = "cbserve.v1.DecodeService"


class DecodeServicer(CommonRPCs, cbserve_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: CoreRuntime) -> None:
        self.rt = runtime
        self.jobs: dict[str, Job] = {}

    # ------------------------------------------------------------------ RPCs
    def _check_transport(self, request: cbserve_pb2.GenerateRequest) -> None:
        transport = request.kv_transport or "grpc"
        if transport not in ("grpc", "nccl"):
            raise ValueError(f"unknown kv_transport {transport!r}")
        if transport == "nccl" and self.rt.pod.kv_transport != "nccl":
            raise ValueError("this decode pod was not started with --kv-transport nccl")

    def open(self, request: cbserve_pb2.GenerateRequest, timeout: float, deliver) -> tuple[OpenRequest, object]:
        """Validate and register a request (raises RequestFailed); queues it in the engine."""
        prompt, params = self.rt.validate(request, self._check_transport)
        if request.prefill_from:   # before anything dials it: only the router names prefill pods
            self.rt.require_kv_handle(request, request.prefill_from)
        req = OpenRequest(self, request, timeout, deliver)
        req.job.kv_handle = request.kv_handle if request.HasField("kv_handle") else None
        return req, req.start(prompt, params, request)

    async def Generate(self, request: cbserve_pb2.GenerateRequest, context):
        """One request on a call of its own (tests and simple clients; the router uses `Session`)."""
        remaining = context.time_remaining()
        outputs: asyncio.Queue = asyncio.Queue()
        try:
            req, added = self.open(request, remaining if remaining is not None else 3600.0, outputs.put_nowait)
        except RequestFailed as e:
            await context.abort(e.code, str(e))
        try:
            try:
                await asyncio.wrap_future(added)
            except Exception as e:  # noqa: BLE001 - the engine refused it: the caller gets why
                await context.abort(*req.failed(refused(e)))
            while not req.finished:
                response, error = req.respond(await drain(outputs))
                if response is not None:
                    yield response
                if error is not None:
                    await context.abort(*req.failed(error))
        finally:
            req.close()

    async def Session(self, request_iterator, context):
        """Many requests on one stream, one message per engine step (see `decode_pod.session`)."""
        async for message in Session(self.open).run(request_iterator):
            yield message


async def serve(runtime: CoreRuntime) -> int:
    servicer = DecodeServicer(runtime)
    return await runtime.serve(lambda server: cbserve_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
                               SERVICE_NAME, pending_work=lambda: len(servicer.jobs))
