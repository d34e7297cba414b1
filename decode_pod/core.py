"""A decode pod's engine-core process: the engine, its thread and the KV pulls, apart from the server.

The pod's server process (`decode_pod.server`, with `decode_pod.core_client`) keeps the gRPC
server, the Sessions, each request's bookkeeping and metrics; this process keeps everything that
touches the engine or its KV cache: the engine thread (`engine.loop.EngineLoop`), and on its event
loop the pulls of KV from prefill pods (which write into the cache) and the commands the server
sends. So the per-request and per-token Python of the server (gRPC handlers, building each
request's response, grpc.aio's own send path) runs on another interpreter and never holds the
engine's GIL, and it runs while the engine computes the next step instead of after it; the
engine-core side of a step is one `CoreEvents` message built in the engine thread and written by a
writer thread. vLLM V1 splits its API server from its engine core the same way; like vLLM's KV
connectors, the KV pulls stay with the engine, so the KV cache never has to be shared across
processes and tensor-parallel pods gather and scatter KV in their rank-0 process as before.

Protocol (`CoreCommand` in, `CoreEvents` out): frames over a socketpair the server created and
passed as a file descriptor (`--engine-core-fd`); each frame is a 4-byte little-endian length and a
protobuf message. Nothing is pickled. The first message out is `ready` (model loaded and warm).
While idle the engine thread still sends a message every 50 ms (statistics, `iteration_at`): the
server's stall watch reads the engine thread's liveness from it. This process exits when the server
says `stop` or its end of the socket closes (the server died), and ignores SIGINT and SIGTERM: the
server drains first, then stops it.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc

from wire import cbserve_pb2, cbserve_pb2_grpc
from decode_pod.open_request import Job, refused
from engine.engine import Engine
from engine.loop import EngineLoop
from engine.outputs import RequestOutput
from kvtransfer.collective import PairGroup, gloo_bind_host, host_store
from kvtransfer.errors import (ChecksumError, KVTransferError, LayoutError, SourceAbortedError,
                               SourceLostError)
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from kvtransfer.pair_setup import open_pair
from pod.runtime import PodRuntime, RequestFailed, logprobs_from_pb, logprobs_to_pb

log = logging.getLogger(__name__)
FRAME = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30


def frame(message) -> bytes:
    data = message.SerializeToString()
    return FRAME.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's message bytes (the server's side); raises asyncio.IncompleteReadError at the
    end of the stream."""
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"engine-core frame of {size} bytes")
    return await reader.readexactly(size)


def stats_to_pb(stats, samples: list, message: cbserve_pb2.CoreStats) -> None:
    """`EngineStats` and numbered step samples [(step, StepSample)] into `message`."""
    message.num_running, message.num_waiting = stats.num_running, stats.num_waiting
    message.prefill_queue_tokens = stats.prefill_queue_tokens
    message.num_free_blocks, message.num_total_blocks = stats.num_free_blocks, stats.num_total_blocks
    message.kv_cache_usage, message.prefix_cache_hit_ratio = stats.kv_cache_usage, stats.prefix_cache_hit_ratio
    message.num_preemptions, message.num_steps = stats.num_preemptions, stats.num_steps
    message.step_seconds_ewma = stats.step_seconds_ewma
    message.prefill_tokens_per_second = stats.prefill_tokens_per_second
    message.first_sample_step = samples[0][0] if samples else 0
    for _, s in samples:
        message.samples.add(num_seqs=s.num_seqs, num_context_tokens=s.num_context_tokens,
                            num_prefill_tokens=s.num_prefill_tokens, seconds=s.seconds)


class Outbox:
    """The engine core's messages, built and sent by a writer thread. The engine thread queues what
    a step produced as it is (one closure, no per-output work), and the writer turns it into a
    `CoreEvents` while the engine computes the next step: output processing overlaps the next step
    instead of following it. One message per item (a request appears at most once in a step); a
    slow reader still gets fewer, larger messages from the server, whose Session sends whatever
    arrived since its last message."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._items: queue.SimpleQueue[Callable[[cbserve_pb2.CoreEvents], None] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="core-writer", daemon=True)
        self._writer.start()

    def put(self, fill: Callable[[cbserve_pb2.CoreEvents], None]) -> None:
        """`fill(events)` runs in the writer thread, in the order of `put`s, on the next message."""
        self._items.put(fill)

    def close(self) -> None:
        self._items.put(None)
        self._writer.join(5.0)

    def _write(self) -> None:
        while (item := self._items.get()) is not None:
            events = cbserve_pb2.CoreEvents()
            item(events)
            try:
                self._sock.sendall(frame(events))
            except OSError:   # the server is gone; the command reader sees it too and exits
                return


class DecodeCore:
    """The engine core of one decode pod: `run()` serves commands until told to stop."""

    def __init__(self, runtime: PodRuntime, sock: socket.socket) -> None:
        self.rt = runtime
        self.sock = sock
        self.outbox = Outbox(sock)
        self.jobs: dict[str, Job] = {}
        self._stubs: dict[str, cbserve_pb2_grpc.PrefillServiceStub] = {}
        self._groups: dict[str, PairGroup] = {}
        self._store = None
        self._group_ids = itertools.count()
        self._group_lock = asyncio.Lock()
        self._steps_sent = 0
        self._stats_sent_at = 0.0

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
        self.outputs([])   # at least every 50 ms: statistics, and proof that the engine thread is alive

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """`EngineLoop` sink, engine thread: queue a step's outputs, with the step times and the
        statistics refreshed since the last call, for the writer thread."""
        engine, rt = self.rt.engine, self.rt
        new = min(engine.num_steps - self._steps_sent, len(engine.step_samples))
        self._steps_sent = engine.num_steps
        steps = [engine.step_samples[-i].seconds for i in range(new, 0, -1)]
        stats = None
        if rt._refreshed_at != self._stats_sent_at:   # snapshot and samples are replaced, never mutated
            self._stats_sent_at = rt._refreshed_at
            stats = (rt.snapshot, rt._samples)
        iteration_at = rt.loop.last_iteration_at
        self.outbox.put(lambda events: self._fill(events, outputs, steps, stats, iteration_at))

    def failure(self, request_id: str, error: BaseException) -> None:
        """`EngineLoop` sink, either thread: `request_id` ended with `error`."""
        code = error.code if isinstance(error, RequestFailed) else grpc.StatusCode.INTERNAL

        def fill(events: cbserve_pb2.CoreEvents) -> None:
            events.errors.add(request_id=request_id, code=code.value[0], message=str(error))
        self.outbox.put(fill)
        self.rt.loop.loop.call_soon_threadsafe(self._forget, request_id)

    def _fill(self, events: cbserve_pb2.CoreEvents, outputs: list[RequestOutput], steps: list[float],
              stats, iteration_at: float) -> None:
        """Writer thread: one step's message. Outputs that are only new tokens go out packed (three
        repeated fields filled in bulk); a request's first output, its last, and outputs with
        logprobs go out as `CoreOutput`s."""
        jobs, ids, counts, tokens = self.jobs, [], [], []
        for out in outputs:
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
            if job is not None and not job.reported:
                job.reported = True
                o.local_prefill = job.local_prefill
                o.kv_transfer_seconds = job.kv_transfer_seconds
                o.kv_pulled_at = job.kv_pulled_at or 0.0
                o.kv_bytes = job.kv_bytes
            if out.finished:
                self.rt.loop.loop.call_soon_threadsafe(self._forget, out.request_id)
        if ids:
            events.token_request_ids.extend(ids)
            events.num_new_tokens.extend(counts)
            events.token_ids.extend(tokens)
        events.step_seconds.extend(steps)
        if stats is not None:
            stats_to_pb(*stats, events.stats)
        events.iteration_at = iteration_at

    # ------------------------------------------------------------------ commands (event loop)
    def _add(self, request: cbserve_pb2.GenerateRequest) -> None:
        rt, req_id = self.rt, request.request_id
        try:
            prompt, params = rt.validate(request)
        except RequestFailed as e:
            self.failure(req_id, e)
            return
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 3600.0
        job = self.jobs[req_id] = Job(request.prefill_from, request.kv_transport or "grpc",
                                      time.monotonic() + timeout)
        job.local_prefill = not request.prefill_from
        job.kv_handle = request.kv_handle if request.HasField("kv_handle") else None
        remote = bool(request.prefill_from)
        added = rt.loop.call(lambda e: e.add_request(prompt, params, req_id, request.priority, remote_kv=remote))

        def on_added(future) -> None:   # engine thread
            if future.exception() is not None:
                self.failure(req_id, refused(future.exception()))
        added.add_done_callback(on_added)

    def _abort(self, req_id: str) -> None:
        self._forget(req_id)
        self.rt.loop.abort(req_id)

    def _forget(self, req_id: str) -> None:
        job = self.jobs.pop(req_id, None)
        if job is not None and job.task is not None and not job.task.done():
            job.task.cancel()   # ends the PullKV stream: the prefill pod frees its blocks

    async def run(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):   # the server drains, then says stop
            signal.signal(sig, signal.SIG_IGN)
        rt = self.rt
        rt.warm_up()
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        rt.loop = EngineLoop(rt.engine, loop, post_step=self.post_step, on_idle=self.on_idle, sink=self)
        ready = cbserve_pb2.CoreEvents()
        ready.ready.model.CopyFrom(rt.model_info)
        ready.ready.block_size, ready.ready.max_num_seqs = rt.block_size, rt.max_num_seqs
        stats_to_pb(rt.snapshot, [], ready.stats)
        ready.iteration_at = time.monotonic()
        self.outbox.put(lambda events: events.MergeFrom(ready))
        rt.loop.start()
        self._stopped = asyncio.Event()
        threading.Thread(target=self._read_commands, args=(loop,), name="core-commands", daemon=True).start()
        await self._stopped.wait()
        rt.loop.stop()
        self.outbox.close()

    def _read_commands(self, loop: asyncio.AbstractEventLoop) -> None:
        """Command-reader thread: each command runs on the event loop, in order."""
        reader = self.sock.makefile("rb", buffering=1 << 16)
        while True:
            header = reader.read(FRAME.size)
            if len(header) < FRAME.size:
                log.warning("the decode pod's server process is gone; the engine core exits")
                os._exit(1)
            (size,) = FRAME.unpack(header)
            command = cbserve_pb2.CoreCommand.FromString(reader.read(size))
            loop.call_soon_threadsafe(self._command, command)
            if command.WhichOneof("kind") == "stop":
                return

    def _command(self, command: cbserve_pb2.CoreCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "add":
            self._add(command.add)
        elif kind == "abort_request_id":
            self._abort(command.abort_request_id)
        elif kind == "stop":
            self._stopped.set()

    # ------------------------------------------------------------------ KV pull (event loop)
    def _start_pull(self, req_id: str, block_ids: tuple[int, ...], num_prompt_tokens: int) -> None:
        job = self.jobs.get(req_id)
        if job is not None and job.task is None and job.prefill_from:
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
            job.kv_bytes = result.num_bytes
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
        it goes out before anything the next step produces for it."""
        out = engine.land_remote_kv(req_id, first_token_id, first_lp)
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


def run_core(runtime: PodRuntime, fd: int) -> int:
    """Entry point of the engine-core process (`cbserve decode ... --engine-core-fd FD`)."""
    sock = socket.socket(fileno=fd)
    asyncio.run(DecodeCore(runtime, sock).run())
    return 0
