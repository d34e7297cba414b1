"""The prefill pod: `Engine(role="prefill")` behind `PrefillService`.

Two processes: this one serves gRPC (calls, checks, metrics, health, drain); the engine, its
thread, the leases on prefilled KV and the KV reads run in an engine-core process
(`prefill_pod.core`, reached through `pod.core_client`), so nothing here can hold the engine's GIL.

`Prefill` answers with the first token as soon as it is sampled. `PullKV` streams the prompt's KV
as each prefill chunk's forward pass completes (and everything already computed at once), ending
with the first token: the engine core reads the blocks and this process forwards its chunks.
Lifetimes: the open pull stream is the lease on the request's blocks — when it ends, breaks or is
cancelled the blocks are released (they stay in the prefix cache) at once; a request that finished
prefill and is not pulled within the TTL is released too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.layout import check_compatible
from pod.core_client import STATUS_CODES, CoreRuntime
from pod.runtime import CommonRPCs, RequestFailed

log = logging.getLogger(__name__)
SERVICE_NAME = "cbserve.v1.PrefillService"


class PrefillServicer(CommonRPCs, cbserve_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runtime: CoreRuntime) -> None:
        self.rt = runtime

    async def Prefill(self, request: cbserve_pb2.PrefillRequest, context) -> cbserve_pb2.PrefillResponse:
        rt, req_id = self.rt, request.request_id
        await rt.intake(request, context)
        if rt.loop.is_subscribed(req_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already here")
        arrival = time.monotonic()
        remaining = context.time_remaining()
        outputs = rt.loop.subscribe(req_id)
        added = done = False
        async with rt.track():
            try:
                rt.loop.prefill(request, remaining if remaining is not None else 3600.0)
                added = True
                async with asyncio.timeout(remaining):   # a timer, not a task
                    item = await outputs.get()
                if isinstance(item, RequestFailed):
                    # Refused as a duplicate: the request already here is not this call's to abort.
                    added = item.code != grpc.StatusCode.ALREADY_EXISTS
                    await context.abort(item.code, str(item))
                done = True
            except asyncio.TimeoutError:
                rt.metrics.request_finished("timeout")
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish before the deadline")
            finally:
                rt.loop.unsubscribe(req_id)
                if added and not done:   # cancelled or failed: nothing will be pulled
                    rt.loop.abort(req_id)
        rt.metrics.ttft.observe(time.monotonic() - arrival)
        rt.metrics.request_finished("prefilled")
        max_tokens_1 = request.sampling.max_tokens == 1
        response = cbserve_pb2.PrefillResponse(
            request_id=req_id, first_token_id=item.new_token_ids[0], num_cached_tokens=item.num_cached_tokens,
            queue_seconds=item.queue_seconds, prefill_seconds=item.prefill_seconds,
            finished=max_tokens_1, finish_reason="length" if max_tokens_1 else "",
            grammar_fingerprint=item.grammar_fingerprint)
        if item.new_logprobs:
            response.first_token_logprobs.CopyFrom(item.new_logprobs[0])
        if item.HasField("prompt_logprobs"):
            response.prompt_logprobs.CopyFrom(item.prompt_logprobs)
        return response

    async def PullKV(self, request: cbserve_pb2.PullKVRequest, context):
        rt, req_id = self.rt, request.request_id
        await rt.check_kv_handle(request, rt.addresses, context,   # raw KV only for a vouched request
                                 hint="; a prefill pod checks handles against its --advertise-address")
        problem = check_compatible(rt.model_info, request.model)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible decode pod: {problem}")
        if req_id in rt.loop.pulls:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already being pulled")
        remaining = context.time_remaining()
        ended = False
        started = time.perf_counter()
        async with rt.track():
            chunks = rt.loop.pull(request, remaining if remaining is not None else 3600.0)
            try:
                while True:
                    item = await chunks.get()
                    if not item.end:
                        yield item.chunk
                        continue
                    ended = True
                    if item.code:
                        await context.abort(STATUS_CODES.get(item.code, grpc.StatusCode.INTERNAL), item.message)
                    rt.metrics.kv_bytes.inc(item.num_bytes)
                    rt.metrics.kv_transfer.observe(time.perf_counter() - started)
                    return
            finally:
                # The lease ends with the stream: the core releases the blocks at once, or aborts the
                # request if the puller left early.
                rt.loop.end_pull(req_id, early=not ended)

    async def SetupTransport(self, request: cbserve_pb2.SetupTransportRequest, context):
        if self.rt.pod.kv_transport != "nccl":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this pod serves KV over gRPC only")
        reply = await asyncio.wrap_future(self.rt.loop.call(cbserve_pb2.CoreCommand(setup_transport=request)))
        if reply.code:
            await context.abort(STATUS_CODES.get(reply.code, grpc.StatusCode.INTERNAL), reply.message)
        return cbserve_pb2.SetupTransportResponse()


async def serve(runtime: CoreRuntime) -> int:
    servicer = PrefillServicer(runtime)
    return await runtime.serve(lambda server: cbserve_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server),
                               SERVICE_NAME, pending_work=lambda: runtime.num_held + len(runtime.loop.pulls))
