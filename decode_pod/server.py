"""The decode pod: `Engine(role="decode")` behind `DecodeService`.

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
import itertools
import logging
import os
import time

import grpc

from wire import cbserve_pb2, cbserve_pb2_grpc
from engine.engine import Engine
from engine.loop import drain
from decode_pod.open_request import Job, OpenRequest, refused
from decode_pod.session import Session
from engine.outputs import RequestOutput
from kvtransfer.collective import PairGroup, gloo_bind_host, host_store
from kvtransfer.pair_setup import open_pair
from kvtransfer.errors import (ChecksumError, KVTransferError, LayoutError, SourceAbortedError,
                               SourceLostError)
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from pod.runtime import CommonRPCs, PodRuntime, RequestFailed, logprobs_from_pb

log = logging.getLogger(__name__)
SERVICE_NAME = "cbserve.v1.DecodeService"


class DecodeServicer(CommonRPCs, cbserve_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: PodRuntime) -> None:
        self.rt = runtime
        self.jobs: dict[str, Job] = {}
        self._stubs: dict[str, cbserve_pb2_grpc.PrefillServiceStub] = {}
        self._groups: dict[str, PairGroup] = {}
        self._store = None
        self._group_ids = itertools.count()
        self._group_lock = asyncio.Lock()

    # ------------------------------------------------------------------ engine thread
    def post_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        schedule = engine.last_schedule
        for req_id in schedule.reserved_request_ids if schedule is not None else ():
            req = engine.scheduler.get_request(req_id)
            if req is not None:
                self.rt.loop.loop.call_soon_threadsafe(self._start_pull, req_id, tuple(req.block_ids),
                                                       req.num_prompt_tokens)
        self.rt.after_step(engine)

    def on_idle(self, engine: Engine) -> None:
        self.rt.refresh(engine)

    # ------------------------------------------------------------------ KV pull
    def _start_pull(self, req_id: str, block_ids: tuple[int, ...], num_prompt_tokens: int) -> None:
        job = self.jobs.get(req_id)
        if job is not None and job.task is None:
            job.task = asyncio.create_task(self._pull(req_id, job, block_ids, num_prompt_tokens))

    def _stub(self, address: str) -> cbserve_pb2_grpc.PrefillServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self.rt.pod.security.channel(address, channel_options())
            stub = self._stubs[address] = cbserve_pb2_grpc.PrefillServiceStub(channel)
        return stub

    async def _group(self, address: str, timeout: float) -> PairGroup:
        """The process group to `address`, set up on first use (this pod hosts the store)."""
        async with self._group_lock:
            group = self._groups.get(address)
            if group is not None and not group.broken:
                return group
            pod = self.rt.pod
            if self._store is None:
                self._store = await asyncio.to_thread(host_store, pod.host, pod.kv_store_port)
            advertise = os.environ.get("CBSERVE_POD_IP") or (pod.host if pod.host != "0.0.0.0" else "127.0.0.1")
            group = await open_pair(
                self._stub(address), self._store, advertise_host=advertise,
                group_name=f"{self.rt.pod_id}->{address}#{next(self._group_ids)}",
                backend="nccl" if self.rt.engine.device.type == "cuda" else "gloo",
                device=self.rt.engine.device, setup_timeout_s=timeout, bind_host=gloo_bind_host(pod.host))
            self._groups[address] = group
            return group

    async def _pull(self, req_id: str, job: Job, block_ids: tuple[int, ...], num_prompt_tokens: int) -> None:
        rt = self.rt
        try:
            group = await self._group(job.prefill_from, job.remaining()) if job.transport == "nccl" else None
            sink = KVSink(rt.engine.kv_cache, block_ids, req_id, num_prompt_tokens, group=group,
                          recv_timeout_s=max(1.0, job.remaining()), **rt.kv_sink_args())
            request = cbserve_pb2.PullKVRequest(request_id=req_id, model=rt.model_info,
                                                transport=job.transport,
                                                nccl_group=group.group_name if group else "",
                                                kv_handle=job.kv_handle)
            result = await pull_kv(self._stub(job.prefill_from), request, sink, timeout=job.remaining())
            job.kv_pulled_at = time.monotonic()
            job.kv_transfer_seconds = result.seconds
            rt.metrics.kv_transfer.observe(result.seconds)
            rt.metrics.kv_bytes.inc(result.num_bytes)
            first_lp = logprobs_from_pb(result.first_token_logprobs)
            await rt.loop.run(lambda e: self._land(e, req_id, result.first_token_id, first_lp))
        except asyncio.CancelledError:
            raise
        except (SourceLostError, SourceAbortedError, grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            await self._fall_back(req_id, job, f"prefill pod {job.prefill_from} lost: {e}")
        except ChecksumError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.DATA_LOSS, f"KV from {job.prefill_from} is corrupt: {e}"))
        except LayoutError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"KV from {job.prefill_from} does not fit this pod: {e}"))
        except KVTransferError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.INTERNAL, f"KV transfer failed: {e}"))

    def _land(self, engine: Engine, req_id: str, first_token_id: int, first_lp) -> None:
        """Engine thread: the request joins the batch; its first token is published from here, so
        it is queued before anything the next step produces for it."""
        out = engine.land_remote_kv(req_id, first_token_id, first_lp)
        if out is not None:
            self.rt.loop.publish([out])

    async def _fall_back(self, req_id: str, job: Job, reason: str) -> None:
        rt = self.rt
        headroom = rt.snapshot.prefill_queue_tokens < rt.pod.fallback_max_queue_tokens
        if rt.pod.local_prefill_fallback and headroom and job.remaining() > 0:
            if await rt.loop.run(lambda e: e.fall_back_to_local_prefill(req_id)):
                job.local_prefill = True
                rt.metrics.local_prefill_fallbacks.inc()
                log.warning("request %s: %s; prefilling locally", req_id, reason)
            return
        self._fail(req_id, RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{reason}; no local prefill headroom"))

    def _fail(self, req_id: str, error: RequestFailed) -> None:
        self.rt.loop.call(lambda e: e.abort(req_id))
        self.rt.loop.fail(req_id, error)

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
        async for message in Session(self).run(request_iterator):
            yield message


async def serve(runtime: PodRuntime) -> None:
    servicer = DecodeServicer(runtime)
    await runtime.serve(lambda server: cbserve_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
                        SERVICE_NAME, post_step=servicer.post_step, on_idle=servicer.on_idle,
                        pending_work=lambda: len(servicer.jobs))
