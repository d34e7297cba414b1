"""A prefill pod's engine core (`pod.core`): the engine, its thread, the leases on prefilled KV and
the KV reads of every pull.

Commands: `prefill` (a `PrefillRequest`), `pull` (a `PullKVRequest` the server has checked: handle,
model), `end_pull_request_id` (the pull's stream ended at the server), `setup_transport` (join a
decode pod's process group: the group lives here, beside the KV it moves), `abort_request_id`,
`stop`. A request's first token goes out as its `CoreOutput`, with its time in the queue and in
prefill; a pull's chunks go out as `CorePullChunk`s, in the message of the moment they are ready
(each prefill chunk's KV as soon as its forward pass is done), ending with one that says how the
pull ended, as a gRPC status the server's stream ends with.

Lifetimes, as they were in the single-process pod: the pull is the lease on the request's
blocks; when it ends, breaks or is cancelled the blocks are released (they stay in the prefix
cache) at once; a request that finished prefill and is not pulled within the TTL is released too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import grpc

from wire import cbserve_pb2
from engine.engine import Engine
from engine.outputs import RequestOutput
from kvtransfer.collective import PairGroup, gloo_bind_host
from kvtransfer.errors import KVTransferError, LayoutError, SourceAbortedError
from kvtransfer.grpc_transport import KVSource
from kvtransfer.leases import HeldKVTable
from kvtransfer.pair_setup import accept_pair
from kvtransfer.progress import KVProgress
from pod.core import EngineCore
from pod.draft_kv import shipped_draft_kv
from pod.lora import identity_mismatch, lora_request, with_adapter
from pod.runtime import RequestFailed, logprobs_to_pb, prompt_logprobs_to_pb, refused

log = logging.getLogger(__name__)
NOT_PREFILLED_SECONDS = 30.0   # a pull waits at most this long for its request to arrive
# TEST FAULT HOOK, never set in production: while this variable is set, the first token handed to
# the decode pod is forged for request ids "forge-fingerprint-*" (a wrong grammar fingerprint) and
# "forge-token-N-*" (token N). Tests drive a decode pod's refusal of a first token with real processes.
FAULT_FIRST_TOKEN_ENV = "CBSERVE_TEST_FAULT_FIRST_TOKEN"


class _PullEnded(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillCore(EngineCore):
    """The engine core of one prefill pod."""

    def __init__(self, runtime, sock) -> None:
        super().__init__(runtime, sock)
        self.progress: dict[str, KVProgress] = {}         # request id -> prefill progress
        self.arrived: dict[str, asyncio.Event] = {}       # pulls that came before their Prefill
        self.pulling: dict[str, asyncio.Task] = {}        # requests with an open pull
        self.lora_identity: dict[str, str] = {}           # request id -> its adapter's identity ("": none)
        self.held = HeldKVTable(runtime.pod.kv_ttl_seconds)
        self.groups: dict[str, PairGroup] = {}
        self._expired = 0
        # "Hold the KV under a TTL" (engine thread) must be decided atomically with "a pull opened /
        # ended, or the request was forgotten" (event loop): otherwise a pull can open, finish and
        # release between the engine's check and its hold, leaving a stale hold that expires 30 s
        # later as a spurious "KV not pulled" (reliability probe, issue 11 case 8).
        self._lease_lock = threading.Lock()
        self._forge = os.environ.get(FAULT_FIRST_TOKEN_ENV) or None

    # ------------------------------------------------------------------ engine thread
    def post_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        kv = engine.scheduler.kv_manager   # with KV groups, groups 1..'s tables travel beside group 0's
        for req in engine.scheduler.last_progressed:
            progress = self.progress.get(req.request_id)
            if progress is not None and req.num_computed_tokens < req.num_prompt_tokens:
                progress.advance(req.num_computed_tokens, req.block_ids, kv.group_tables(req.request_id))
        for out in outputs:
            req_id = out.request_id
            progress = self.progress.get(req_id)
            request = engine.scheduler.held.get(req_id)
            if progress is None or request is None:
                continue
            lp = out.new_logprobs[0] if out.new_logprobs else None
            spec = request.sampling_params.structured
            out.grammar_fingerprint = engine.structured.fingerprint(spec) if spec is not None else ""
            # Hold *before* publishing the first token: no pull can complete before `finish`, so
            # every pull that ends after this point finds the hold and releases it (`_forget`).
            with self._lease_lock:
                if self.progress.get(req_id) is progress and req_id not in self.pulling:
                    self.held.hold(req_id, request.block_ids, request.num_prompt_tokens)
            token, fingerprint = out.new_token_ids[0], out.grammar_fingerprint
            if self._forge is not None and req_id.startswith("forge-"):
                token, fingerprint = self._forged(req_id, token, fingerprint)
            progress.finish(token, request.block_ids, logprobs_to_pb(lp), fingerprint,
                            prompt_logprobs_to_pb(out.prompt_logprobs), kv.group_tables(req_id))
        self.rt.after_step(engine, self.held.num_held)

    @staticmethod
    def _forged(req_id: str, token: int, fingerprint: str) -> tuple[int, str]:
        """TEST FAULT HOOK (see FAULT_FIRST_TOKEN_ENV)."""
        if req_id.startswith("forge-fingerprint-"):
            return token, "0" * 64
        if req_id.startswith("forge-token-"):
            return int(req_id.split("-")[2]), fingerprint
        return token, fingerprint

    def on_idle(self, engine: Engine) -> None:
        for req_id in self.held.expire():
            engine.scheduler.release_request(req_id)
            self._expired += 1
            progress = self.progress.pop(req_id, None)
            self.lora_identity.pop(req_id, None)
            if progress is not None:
                progress.fail("KV lease expired before a decode pod pulled it")
            log.info("request %s: KV not pulled within %.0fs, released", req_id, self.rt.pod.kv_ttl_seconds)
        self.rt.refresh(engine, self.held.num_held)
        self.outputs([])

    def step_extras(self) -> int:
        expired, self._expired = self._expired, 0
        return expired

    def fill_outputs(self, events: cbserve_pb2.CoreEvents, outputs: list[RequestOutput], expired: int) -> None:
        """Writer thread: each output is a request's first token."""
        for out in outputs:
            scheduled = out.first_scheduled_time or out.first_token_time
            o = events.outputs.add(request_id=out.request_id, new_token_ids=out.new_token_ids,
                                   finished=out.finished, finish_reason=out.finish_reason or "",
                                   num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                                   queue_seconds=scheduled - out.arrival_time,
                                   prefill_seconds=out.first_token_time - scheduled,
                                   grammar_fingerprint=out.grammar_fingerprint)
            if out.new_logprobs and out.new_logprobs[0] is not None:
                o.new_logprobs.extend(logprobs_to_pb(lp) for lp in out.new_logprobs)
            if out.prompt_logprobs is not None:
                out.prompt_logprobs.to_proto(o.prompt_logprobs)
        events.lease_expiries = expired

    # ------------------------------------------------------------------ commands (event loop)
    def command(self, kind: str, command: cbserve_pb2.CoreCommand) -> None:
        if kind == "prefill":
            self._prefill(command.prefill)
        elif kind == "pull":
            self._pull(command.pull, command.timeout_seconds)
        elif kind == "end_pull_request_id":
            task = self.pulling.get(command.end_pull_request_id)
            if task is not None:
                task.cancel()
        elif kind == "setup_transport":
            asyncio.create_task(self._setup_transport(command.setup_transport, command.call_id))

    def abort(self, request_id: str, call_id: int) -> None:
        with self._lease_lock:
            self._forget(request_id, "aborted")
        super().abort(request_id, call_id)

    def _prefill(self, request: cbserve_pb2.PrefillRequest) -> None:
        rt, req_id = self.rt, request.request_id
        if req_id in self.progress:   # refused without touching the request that is here
            self.send_error(req_id, RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already here"))
            return
        try:
            prompt, params = rt.validate(request)
            lora = lora_request(rt, request)
        except RequestFailed as e:
            self.failure(req_id, e)
            return
        progress = self.progress[req_id] = KVProgress(len(prompt))
        self.lora_identity[req_id] = lora.identity if lora else ""
        if req_id in self.arrived:
            self.arrived[req_id].set()

        def on_added(future) -> None:   # engine thread
            if future.exception() is not None:
                self.failure(req_id, refused(future.exception()))

        def add() -> None:   # the adapter, if any, is in host memory now
            if self.progress.get(req_id) is not progress:   # aborted while its adapter was read
                return
            rt.loop.call(lambda e: e.add_request(prompt, params, req_id, request.priority,
                                                 lora=lora)).add_done_callback(on_added)
        with_adapter(rt, lora, add, lambda error: self.failure(req_id, error))

    def forget(self, request_id: str) -> None:
        """A failed request (refused, step failed): nothing will be pulled."""
        with self._lease_lock:
            self._forget(request_id, "prefill failed")

    def _forget(self, req_id: str, reason: str) -> None:
        self.held.release(req_id)
        self.lora_identity.pop(req_id, None)
        progress = self.progress.pop(req_id, None)
        if progress is not None:
            progress.fail(reason)

    # ------------------------------------------------------------------ KV pulls (event loop)
    def _pull(self, request: cbserve_pb2.PullKVRequest, timeout: float) -> None:
        req_id = request.request_id
        group = None
        try:
            if request.transport == "nccl":
                group = self.groups.get(request.nccl_group)
                if group is None or group.broken:
                    raise _PullEnded(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"no live process group {request.nccl_group!r}: call SetupTransport")
            elif request.transport not in ("", "grpc"):
                raise _PullEnded(grpc.StatusCode.INVALID_ARGUMENT, f"unknown transport {request.transport!r}")
            with self._lease_lock:
                if req_id in self.pulling:
                    raise _PullEnded(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is already being pulled")
                task = self.pulling[req_id] = asyncio.create_task(self._stream(request, group, timeout))
        except _PullEnded as e:
            self._end_pull(req_id, e.code, str(e))
            return
        task.add_done_callback(lambda t: self._pull_done(req_id, t))

    async def _stream(self, request: cbserve_pb2.PullKVRequest, group: PairGroup | None, timeout: float) -> int:
        req_id, rt = request.request_id, self.rt
        progress = await self._wait_for_prefill(req_id, timeout)
        mismatch = identity_mismatch(req_id, request.lora_identity, self.lora_identity.get(req_id, ""))
        if mismatch:
            raise _PullEnded(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        self.held.take(req_id)  # the stream holds the lease from now on
        # Every layer windowed: only the blocks the decode pod's first query reads (the handshake's
        # kv_transfer_window made both pods agree on the window, so on this index too).
        # KV groups: each windowed group's pages from the one its first decode query reads
        # (kvtransfer.kv_groups; the handshake compared the groups).
        start, group_starts = rt.engine.scheduler.kv_manager.pull_starts(progress.num_prompt_tokens)
        source = KVSource(rt.engine.kv_cache, req_id, progress.num_prompt_tokens, start_block_index=start,
                          group_start_block_indices=group_starts,
                          max_chunk_bytes=request.max_chunk_bytes, group=group,
                          draft_kv=shipped_draft_kv(rt.draft_kv, rt.model_info, request.model, start),
                          **rt.kv_source_args())
        async for chunk in source.chunks(progress.events()):
            self.outbox.put(lambda events, c=chunk: events.pull_chunks.add(request_id=req_id).chunk.CopyFrom(c))
        return source.num_bytes_sent

    def _pull_done(self, req_id: str, task: asyncio.Task) -> None:
        """The pull is over: end its stream at the server (unless the server ended it) and end the
        lease: release at once, or abort if the puller left early."""
        completed = False
        if task.cancelled():   # the server's stream ended first: nothing more to say
            pass
        elif isinstance(task.exception(), (SourceAbortedError, LayoutError)):
            # LayoutError: the request's blocks moved under the stream (preempted by recompute): the
            # puller cannot use what it has; ABORTED makes it prefill locally instead.
            self._end_pull(req_id, grpc.StatusCode.ABORTED, str(task.exception()))
        elif isinstance(task.exception(), _PullEnded):
            self._end_pull(req_id, task.exception().code, str(task.exception()))
        elif task.exception() is not None:
            if not isinstance(task.exception(), KVTransferError):
                log.error("request %s: KV pull failed", req_id, exc_info=task.exception())
            self._end_pull(req_id, grpc.StatusCode.INTERNAL, str(task.exception()))
        else:
            completed = True
            self._end_pull(req_id, grpc.StatusCode.OK, "", num_bytes=task.result())
        with self._lease_lock:
            self.pulling.pop(req_id, None)
            self._forget(req_id, "pull finished" if completed else "pull cancelled")
        if completed:
            self.rt.loop.call(lambda e: e.scheduler.release_request(req_id))
        else:
            self.rt.loop.abort(req_id)
            self.rt.loop.fail(req_id, RequestFailed(grpc.StatusCode.ABORTED, "the decode pod's KV pull ended early"))

    def _end_pull(self, req_id: str, code: grpc.StatusCode, message: str, num_bytes: int = 0) -> None:
        self.outbox.put(lambda events: events.pull_chunks.add(request_id=req_id, end=True, code=code.value[0],
                                                              message=message, num_bytes=num_bytes))

    async def _wait_for_prefill(self, req_id: str, timeout: float) -> KVProgress:
        """Concurrent dispatch: the pull may arrive before the Prefill call it belongs to."""
        progress = self.progress.get(req_id)
        if progress is None:
            event = self.arrived.setdefault(req_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), min(timeout or NOT_PREFILLED_SECONDS, NOT_PREFILLED_SECONDS))
            except asyncio.TimeoutError:
                raise _PullEnded(grpc.StatusCode.NOT_FOUND,
                                 f"request {req_id!r} never reached this prefill pod") from None
            finally:
                self.arrived.pop(req_id, None)
            progress = self.progress.get(req_id)
            if progress is None:
                raise _PullEnded(grpc.StatusCode.NOT_FOUND, f"request {req_id!r} is gone")
        return progress

    async def _setup_transport(self, request: cbserve_pb2.SetupTransportRequest, call_id: int) -> None:
        old = self.groups.pop(request.group, None)
        if old is not None:
            old.close()
        try:
            self.groups[request.group] = await accept_pair(request, device=self.rt.engine.device,
                                                           bind_host=gloo_bind_host(self.rt.pod.host))
        except ValueError as e:
            self.reply(call_id, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (KVTransferError, RuntimeError) as e:
            self.reply(call_id, grpc.StatusCode.UNAVAILABLE, f"process group setup failed: {e}")
        except Exception as e:  # noqa: BLE001 - the server's call waits for a reply: it gets one
            log.exception("process group setup failed")
            self.reply(call_id, grpc.StatusCode.INTERNAL, f"process group setup failed: {e}")
        else:
            self.reply(call_id)
