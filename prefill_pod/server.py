"""The prefill pod: `Engine(role="prefill")` behind `PrefillService`.

`Prefill` answers with the first token as soon as it is sampled. `PullKV` streams the prompt's KV
as each prefill chunk's forward pass completes (and everything already computed at once), ending
with the first token. Lifetimes: the open pull stream is the lease on the request's blocks —
when it ends, breaks or is cancelled the blocks are released (they stay in the prefix cache) at
once; a request that finished prefill and is not pulled within the TTL is released too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from wire import cbserve_pb2, cbserve_pb2_grpc
from engine.engine import Engine
from engine.outputs import RequestOutput
from kvtransfer.collective import PairGroup, gloo_bind_host
from kvtransfer.pair_setup import accept_pair
from kvtransfer.errors import KVTransferError, LayoutError, SourceAbortedError
from kvtransfer.grpc_transport import KVSource
from kvtransfer.layout import check_compatible
from kvtransfer.leases import HeldKVTable
from kvtransfer.progress import KVProgress
from pod.runtime import CommonRPCs, PodRuntime, RequestFailed, logprobs_to_pb

log = logging.getLogger(__name__)
SERVICE_NAME = "cbserve.v1.PrefillService"


class PrefillServicer(CommonRPCs, cbserve_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runtime: PodRuntime) -> None:
        self.rt = runtime
        self.progress: dict[str, KVProgress] = {}         # request id -> prefill progress
        self.arrived: dict[str, asyncio.Event] = {}       # pulls that came before their Prefill
        self.pulling: set[str] = set()                    # requests with an open PullKV stream
        self.held = HeldKVTable(runtime.pod.kv_ttl_seconds)
        self.groups: dict[str, PairGroup] = {}
        # "Hold the KV under a TTL" (engine thread) must be decided atomically with "a pull opened /
        # ended, or the request was forgotten" (event loop): otherwise a pull can open, finish and
        # release between the engine's check and its hold, leaving a stale hold that expires 30 s
        # later as a spurious "KV not pulled" (reliability probe, issue 11 case 8).
        self._lease_lock = threading.Lock()

    # ------------------------------------------------------------------ engine thread
    def post_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        for req in engine.scheduler.last_progressed:
            progress = self.progress.get(req.request_id)
            if progress is not None and req.num_computed_tokens < req.num_prompt_tokens:
                progress.advance(req.num_computed_tokens, req.block_ids)
        for out in outputs:
            req_id = out.request_id
            progress = self.progress.get(req_id)
            request = engine.scheduler.held.get(req_id)
            if progress is None or request is None:
                continue
            lp = out.new_logprobs[0] if out.new_logprobs else None
            # Hold *before* publishing the first token: no pull can complete before `finish`, so
            # every pull that ends after this point finds the hold and releases it (`_forget`).
            with self._lease_lock:
                if self.progress.get(req_id) is progress and req_id not in self.pulling:
                    self.held.hold(req_id, request.block_ids, request.num_prompt_tokens)
            progress.finish(out.new_token_ids[0], request.block_ids, logprobs_to_pb(lp))
        self.rt.after_step(engine, self.held.num_held)

    def on_idle(self, engine: Engine) -> None:
        for req_id in self.held.expire():
            engine.scheduler.release_request(req_id)
            self.rt.metrics.lease_expiries.inc()
            progress = self.progress.pop(req_id, None)
            if progress is not None:
                progress.fail("KV lease expired before a decode pod pulled it")
            log.info("request %s: KV not pulled within %.0fs, released", req_id, self.rt.pod.kv_ttl_seconds)
        self.rt.refresh(engine, self.held.num_held)

    # ------------------------------------------------------------------ RPCs
    async def Abort(self, request, context):
        with self._lease_lock:
            self._forget(request.request_id, "aborted")
        return await super().Abort(request, context)

    async def Prefill(self, request: cbserve_pb2.PrefillRequest, context) -> cbserve_pb2.PrefillResponse:
        rt, req_id = self.rt, request.request_id
        prompt, params = await rt.intake(request, context)
        if req_id in self.progress:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already here")
        arrival = time.monotonic()
        self.progress[req_id] = KVProgress(len(prompt))
        if req_id in self.arrived:
            self.arrived[req_id].set()
        outputs = rt.loop.subscribe(req_id)
        done = False
        async with rt.track():
            try:
                await rt.loop.run(lambda e: e.add_request(prompt, params, req_id, request.priority))
                async with asyncio.timeout(context.time_remaining()):   # a timer, not a task
                    item = await outputs.get()
                if isinstance(item, RequestFailed):
                    await context.abort(item.code, str(item))
                if isinstance(item, BaseException):
                    raise item
                done = True
            except asyncio.TimeoutError:
                rt.metrics.request_finished("timeout")
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish before the deadline")
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                rt.loop.unsubscribe(req_id)
                if not done:   # cancelled or failed: nothing will be pulled
                    with self._lease_lock:
                        self._forget(req_id, "prefill cancelled")
                    rt.loop.abort(req_id)
        ttft = time.monotonic() - arrival
        rt.metrics.ttft.observe(ttft)
        rt.metrics.request_finished("prefilled")
        # Engine timestamps are monotonic, like `arrival`: no second trip to the engine thread.
        scheduled = item.first_scheduled_time or item.first_token_time
        queue_s, prefill_s = scheduled - item.arrival_time, item.first_token_time - scheduled
        lp = logprobs_to_pb(item.new_logprobs[0] if item.new_logprobs else None)
        response = cbserve_pb2.PrefillResponse(
            request_id=req_id, first_token_id=item.new_token_ids[0], num_cached_tokens=item.num_cached_tokens,
            queue_seconds=queue_s, prefill_seconds=prefill_s,
            finished=params.max_tokens == 1, finish_reason="length" if params.max_tokens == 1 else "")
        if lp is not None:
            response.first_token_logprobs.CopyFrom(lp)
        return response

    async def PullKV(self, request: cbserve_pb2.PullKVRequest, context):
        rt, req_id = self.rt, request.request_id
        await rt.check_kv_handle(request, rt.addresses, context,   # raw KV only for a vouched request
                                 hint="; a prefill pod checks handles against its --advertise-address")
        problem = check_compatible(rt.model_info, request.model)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible decode pod: {problem}")
        group = None
        if request.transport == "nccl":
            group = self.groups.get(request.nccl_group)
            if group is None or group.broken:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"no live process group {request.nccl_group!r}: call SetupTransport")
        elif request.transport not in ("", "grpc"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown transport {request.transport!r}")
        with self._lease_lock:
            already = req_id in self.pulling
            self.pulling.add(req_id)
        if already:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already being pulled")
        completed = False
        started = time.perf_counter()
        async with rt.track():
            try:
                progress = await self._wait_for_prefill(req_id, context)
                self.held.take(req_id)  # the stream holds the lease from now on
                source = KVSource(rt.engine.kv_cache, req_id, progress.num_prompt_tokens,
                                  max_chunk_bytes=request.max_chunk_bytes, group=group, **rt.kv_source_args())
                async for chunk in source.chunks(progress.events()):
                    yield chunk
                completed = True
                rt.metrics.kv_bytes.inc(source.num_bytes_sent)
                rt.metrics.kv_transfer.observe(time.perf_counter() - started)
            except SourceAbortedError as e:
                await context.abort(grpc.StatusCode.ABORTED, str(e))
            except LayoutError as e:
                # The request's blocks moved under the stream (preempted by recompute): the puller
                # cannot use what it has; ABORTED makes it prefill locally instead.
                await context.abort(grpc.StatusCode.ABORTED, str(e))
            except KVTransferError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                # The lease ends with the stream: release at once, or abort if the puller left early.
                with self._lease_lock:
                    self.pulling.discard(req_id)
                    self._forget(req_id, "pull finished" if completed else "pull cancelled")
                if completed:
                    rt.loop.call(lambda e: e.scheduler.release_request(req_id))
                else:
                    rt.abort_request_nowait(req_id, "the decode pod's KV pull ended early")

    async def _wait_for_prefill(self, req_id: str, context) -> KVProgress:
        """Concurrent dispatch: the pull may arrive before the Prefill call it belongs to."""
        progress = self.progress.get(req_id)
        if progress is None:
            event = self.arrived.setdefault(req_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), min(context.time_remaining() or 30.0, 30.0))
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request {req_id!r} never reached this prefill pod")
            finally:
                self.arrived.pop(req_id, None)
            progress = self.progress.get(req_id)
            if progress is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request {req_id!r} is gone")
        return progress

    def _forget(self, req_id: str, reason: str) -> None:
        self.held.release(req_id)
        progress = self.progress.pop(req_id, None)
        if progress is not None:
            progress.fail(reason)

    async def SetupTransport(self, request: cbserve_pb2.SetupTransportRequest, context):
        if self.rt.pod.kv_transport != "nccl":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this pod serves KV over gRPC only")
        old = self.groups.pop(request.group, None)
        if old is not None:
            old.close()
        try:
            self.groups[request.group] = await accept_pair(request, device=self.rt.engine.device,
                                                           bind_host=gloo_bind_host(self.rt.pod.host))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (KVTransferError, RuntimeError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"process group setup failed: {e}")
        return cbserve_pb2.SetupTransportResponse()


async def serve(runtime: PodRuntime) -> int:
    servicer = PrefillServicer(runtime)
    return await runtime.serve(lambda server: cbserve_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server),
                               SERVICE_NAME, post_step=servicer.post_step, on_idle=servicer.on_idle,
                               pending_work=lambda: servicer.held.num_held + len(servicer.pulling))
