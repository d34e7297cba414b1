"""A decode pod's engine core (`pod.core`): the engine, its thread and the KV pulls.

Commands: `add` (a `GenerateRequest`, with its remaining time), `abort_request_id`, `stop`. Each
request's KV is pulled from its prefill pod here, on this process's event loop, as soon as the
engine has reserved blocks for it, and lands in the batch through a command to the engine thread.
A step's outputs go out as every request's new tokens: packed when they are only tokens, as a
`CoreOutput` for a request's first output (with how its KV arrived), its last, and outputs with
logprobs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import grpc

from wire import cbserve_pb2, cbserve_pb2_grpc
from decode_pod.open_request import Job
from engine.engine import Engine
from engine.grammar.backend import GrammarCompileError
from engine.grammar.structured_outputs import FirstTokenRejected
from engine.outputs import RequestOutput
from engine.prompt_logprobs import PromptLogprobs
from engine.step_outputs import split
from kvtransfer.collective import PairGroup, gloo_bind_host, host_store
from kvtransfer.errors import (ChecksumError, KVTransferError, LayoutError, SourceAbortedError,
                               SourceLostError)
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from kvtransfer.pair_setup import open_pair
from pod.core import EngineCore
from pod.lora import lora_request, with_adapter
from pod.runtime import RequestFailed, logprobs_from_pb, logprobs_to_pb, refused

log = logging.getLogger(__name__)


class DecodeCore(EngineCore):
    """The engine core of one decode pod."""

    def __init__(self, runtime, sock) -> None:
        super().__init__(runtime, sock)
        self.jobs: dict[str, Job] = {}
        self._stubs: dict[str, cbserve_pb2_grpc.PrefillServiceStub] = {}
        self._groups: dict[str, PairGroup] = {}
        self._store = None
        self._group_ids = itertools.count()
        self._group_lock = asyncio.Lock()

    # ------------------------------------------------------------------ engine thread
    def post_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        schedule = engine.last_schedule
        kv = engine.scheduler.kv_manager   # with KV groups, groups 1..'s reserved tables go to the pull too
        for req_id in schedule.reserved_request_ids if schedule is not None else ():
            req = engine.scheduler.get_request(req_id)
            if req is not None:
                self.rt.loop.loop.call_soon_threadsafe(self._start_pull, req_id, tuple(req.block_ids),
                                                       req.num_prompt_tokens, req.lora.identity if req.lora else "",
                                                       kv.group_tables(req_id))
        self.rt.after_step(engine)

    def fill_outputs(self, events: cbserve_pb2.CoreEvents, outputs: list[RequestOutput], extra) -> None:
        """Writer thread: outputs that are only new tokens go out packed (three repeated fields
        filled in bulk); a request's first output, its last, and outputs with logprobs go out as
        `CoreOutput`s. A step's token rows (`engine.step_outputs`) are packed as they come, but
        for a request whose first output this is."""
        jobs = self.jobs
        ids, tokens, others = split(outputs, self._first_output)
        counts = [1] * len(ids)
        for out in others:
            job = jobs.get(out.request_id)
            if not out.finished and (job is None or job.reported) and \
                    not (out.new_logprobs and out.new_logprobs[0] is not None):
                ids.append(out.request_id)
                counts.append(len(out.new_token_ids))
                tokens += out.new_token_ids
                continue
            o = events.outputs.add(request_id=out.request_id, new_token_ids=out.new_token_ids,
                                   finished=out.finished, finish_reason=out.finish_reason or "",
                                   num_prompt_tokens=out.num_prompt_tokens,
                                   num_cached_tokens=out.num_cached_tokens)
            if out.new_logprobs and out.new_logprobs[0] is not None:
                o.new_logprobs.extend(logprobs_to_pb(lp) for lp in out.new_logprobs)
            if out.prompt_logprobs is not None:    # a first output: never packed
                out.prompt_logprobs.to_proto(o.prompt_logprobs)
            if job is not None and not job.reported:
                job.reported = True
                o.local_prefill = job.local_prefill
                o.kv_transfer_seconds = job.kv_transfer_seconds
                o.kv_pulled_at = job.kv_pulled_at or 0.0
                o.kv_bytes = job.kv_bytes
                o.draft_kv_shipped = job.draft_kv_shipped
            if out.finished:
                self.rt.loop.loop.call_soon_threadsafe(self.forget, out.request_id)
        if ids:
            events.token_request_ids.extend(ids)
            events.num_new_tokens.extend(counts)
            events.token_ids.extend(tokens)

    def _first_output(self, request_id: str) -> bool:
        """Writer thread: `request_id`'s next output is the first one reported (it carries the
        request's KV transfer figures)."""
        job = self.jobs.get(request_id)
        return job is not None and not job.reported

    # ------------------------------------------------------------------ commands (event loop)
    def _add(self, request: cbserve_pb2.GenerateRequest) -> None:
        rt, req_id = self.rt, request.request_id
        try:
            prompt, params = rt.validate(request)
            lora = lora_request(rt, request)
        except RequestFailed as e:
            self.failure(req_id, e)
            return
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 3600.0
        job = self.jobs[req_id] = Job(request.prefill_from, request.kv_transport or "grpc",
                                      time.monotonic() + timeout)
        job.local_prefill = not request.prefill_from
        job.kv_handle = request.kv_handle if request.HasField("kv_handle") else None
        job.structured = params.structured
        remote = bool(request.prefill_from)

        def on_added(future) -> None:   # engine thread
            if future.exception() is not None:
                self.failure(req_id, refused(future.exception()))
            elif remote and params.structured is not None:
                rt.engine.structured.compile_future(params.structured).add_done_callback(on_compiled)

        def on_compiled(compiled) -> None:   # compile thread
            # A grammar this pod cannot compile fails the request now, not after the pull.
            if compiled.exception() is not None:
                error = RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(compiled.exception()))
                rt.loop.loop.call_soon_threadsafe(self._fail, req_id, error)

        def add() -> None:   # the adapter, if any, is in host memory now
            if self.jobs.get(req_id) is not job:   # aborted while its adapter was read
                return
            rt.loop.call(lambda e: e.add_request(prompt, params, req_id, request.priority, remote_kv=remote,
                                                 lora=lora)).add_done_callback(on_added)
        with_adapter(rt, lora, add, lambda error: self.failure(req_id, error))

    def forget(self, req_id: str) -> None:
        job = self.jobs.pop(req_id, None)
        if job is not None and job.task is not None and not job.task.done():
            job.task.cancel()   # ends the PullKV stream: the prefill pod frees its blocks

    def command(self, kind: str, command: cbserve_pb2.CoreCommand) -> None:
        if kind == "add":
            self._add(command.add)

    # ------------------------------------------------------------------ KV pull (event loop)
    def _start_pull(self, req_id: str, block_ids: tuple[int, ...], num_prompt_tokens: int,
                    lora_identity: str = "", group_block_ids: tuple[tuple[int, ...], ...] = ()) -> None:
        job = self.jobs.get(req_id)
        if job is not None and job.task is None and job.prefill_from:
            job.task = asyncio.create_task(self._pull(req_id, job, block_ids, num_prompt_tokens, lora_identity,
                                                      group_block_ids))

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

    async def _pull(self, req_id: str, job: Job, block_ids: tuple[int, ...], num_prompt_tokens: int,
                    lora_identity: str = "", group_block_ids: tuple[tuple[int, ...], ...] = ()) -> None:
        rt = self.rt
        try:
            group = await self._group(job.prefill_from, job.remaining()) if job.transport == "nccl" else None
            # Every layer windowed: the blocks before `start` were never reserved (null entries).
            # KV groups: each windowed group's pages before its window's start were never reserved.
            start, group_starts = rt.engine.scheduler.kv_manager.pull_starts(num_prompt_tokens)
            sink = KVSink(rt.engine.kv_cache, block_ids, req_id, num_prompt_tokens, group=group,
                          recv_timeout_s=max(1.0, job.remaining()), start_block_index=start, draft_kv=rt.draft_kv,
                          group_dst_block_ids=group_block_ids, group_start_block_indices=group_starts,
                          **rt.kv_sink_args())
            request = cbserve_pb2.PullKVRequest(request_id=req_id, model=rt.model_info,
                                                transport=job.transport,
                                                nccl_group=group.group_name if group else "",
                                                kv_handle=job.kv_handle, lora_identity=lora_identity)
            result = await pull_kv(self._stub(job.prefill_from), request, sink, timeout=job.remaining())
            job.kv_pulled_at = time.monotonic()
            job.kv_transfer_seconds = result.seconds
            job.kv_bytes = result.num_bytes
            job.draft_kv_shipped = result.draft_kv
            first_lp = logprobs_from_pb(result.first_token_logprobs)
            prompt_lp = None if result.prompt_logprobs is None else PromptLogprobs.from_proto(result.prompt_logprobs)
            if job.structured is not None:   # compiled while P prefilled; landing must not wait for it
                compiled = rt.engine.structured.compile_future(job.structured)
                if not compiled.done():   # else no await: it would cost a loop iteration (a wake-up)
                    await asyncio.wrap_future(compiled)
            await rt.loop.run(lambda e: self._land(e, req_id, result.first_token_id, first_lp,
                                                   result.grammar_fingerprint, prompt_lp, result.draft_kv))
        except asyncio.CancelledError:
            raise
        except FirstTokenRejected as e:
            # Never an unconstrained token: this pod samples token 0 itself, under its own grammar.
            await self._fall_back(req_id, job, f"prefill pod {job.prefill_from}'s first token refused: {e}")
        except GrammarCompileError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except (SourceLostError, SourceAbortedError, grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            await self._fall_back(req_id, job, f"prefill pod {job.prefill_from} lost: {e}")
        except ChecksumError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.DATA_LOSS, f"KV from {job.prefill_from} is corrupt: {e}"))
        except LayoutError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"KV from {job.prefill_from} does not fit this pod: {e}"))
        except KVTransferError as e:
            self._fail(req_id, RequestFailed(grpc.StatusCode.INTERNAL, f"KV transfer failed: {e}"))

    def _land(self, engine: Engine, req_id: str, first_token_id: int, first_lp, grammar_fingerprint: str,
              prompt_lp: PromptLogprobs | None, draft_kv: bool = False) -> None:
        """Engine thread: the request joins the batch; its first token (and the prompt's scores,
        which the prefill pod computed) is published from here, so it goes out before anything the
        next step produces for it. A structured request's token must come from the same grammar
        and be accepted by this pod's (else `FirstTokenRejected`). `draft_kv`: the draft model's KV
        of the prompt came too: its proposer skips the catch-up over the prompt."""
        request = engine.scheduler.get_request(req_id)
        out = engine.land_remote_kv(req_id, first_token_id, first_lp, grammar_fingerprint, prompt_lp)
        if draft_kv and request is not None:   # after the landing: a refused first token changes nothing
            engine.spec.draft.received(request)
        if out is not None:
            self.rt.loop.publish([out])

    async def _fall_back(self, req_id: str, job: Job, reason: str) -> None:
        rt = self.rt
        headroom = rt.snapshot.prefill_queue_tokens < rt.pod.fallback_max_queue_tokens
        if rt.pod.local_prefill_fallback and headroom and job.remaining() > 0:
            def fall_back(engine: Engine) -> bool:   # engine thread: marked before its first token
                job.local_prefill = engine.fall_back_to_local_prefill(req_id)
                return job.local_prefill
            if await rt.loop.run(fall_back):
                log.warning("request %s: %s; prefilling locally", req_id, reason)
            return
        self._fail(req_id, RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{reason}; no local prefill headroom"))

    def _fail(self, req_id: str, error: RequestFailed) -> None:
        self.rt.loop.abort(req_id)
        self.rt.loop.fail(req_id, error)
