"""The server side of a pod's engine core (`pod.core`): where the engine lives for the pod's gRPC
server.

`CoreRuntime` is the pod runtime without an engine of its own: it starts the engine-core process
before the server listens, takes the model's description from its `ready` message, and keeps the
statistics and step samples the core sends (load reports and metrics read them, as they read the
engine thread's snapshot in a pod with its engine in-process). `EngineCoreClient` stands where
`engine.loop.EngineLoop` stands in such a pod: requests go out as commands; each `CoreEvents`
message costs the event loop one wake, and hands every request's `CoreOutput`s to its subscriber,
a prefill pod's KV chunks to the pull stream they belong to, and replies to the calls awaiting them.

If the engine core exits, every open request and KV pull fails with UNAVAILABLE (the router retries it
elsewhere), the pod reports NOT_SERVING and exits with the core's exit code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from wire import cbserve_pb2
from pod.core import FrameReader, frame
from engine.loop import Subscribers
from engine.outputs import EngineStats
from engine.spec_decode.metrics import stats_from_pb as spec_stats_from_pb
from engine.lora.stats import stats_from_pb as lora_stats_from_pb
from pod.runtime import PodRuntime, RequestFailed

log = logging.getLogger(__name__)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
ROOT = Path(__file__).resolve().parent.parent
STOP_SECONDS = 10.0
SOCKET_BUFFER_BYTES = 4 << 20


class NewTokens:
    """A step's new tokens for a request, from `CoreEvents`' packed fields: reads like a
    `CoreOutput` that is neither the request's first nor its last and has no logprobs."""

    __slots__ = ("new_token_ids",)
    new_logprobs = ()
    finished = False
    finish_reason = ""
    num_prompt_tokens = num_cached_tokens = kv_bytes = 0
    local_prefill = False
    kv_transfer_seconds = kv_pulled_at = 0.0

    def __init__(self, new_token_ids: list[int]) -> None:
        self.new_token_ids = new_token_ids


class EngineCoreExited(RuntimeError):
    def __init__(self, code: int) -> None:
        super().__init__(f"the engine-core process exited with code {code} before it was ready")
        self.code = code if code > 0 else 1


class CoreRuntime(PodRuntime):
    """A pod's runtime whose engine runs in an engine-core process (`argv`: the pod's
    command line, which the core process gets too, with `--engine-core-fd`)."""

    owns_engine = False

    def __init__(self, engine_config, pod, role_label: str, argv: list[str]) -> None:
        super().__init__(engine_config, pod, role_label)
        self.argv = argv

    def parse(self, prompt_token_ids, sampling, request_id: str):
        """The server checks what needs no engine; the engine core validates the rest and refuses
        a bad request with INVALID_ARGUMENT through its output stream."""
        if not request_id:
            raise ValueError("request_id is required")
        return None, None

    async def start_engine(self, service_name: str, post_step, on_idle) -> None:
        self.loop = EngineCoreClient(self, service_name)
        await self.loop.start(self.argv)
        gc.collect()   # what lives now lives as long as the process (see PodRuntime.start_engine)
        gc.freeze()

    def apply_ready(self, ready: cbserve_pb2.CoreReady) -> None:
        self.model_info = ready.model
        self.block_size, self.max_num_seqs = ready.block_size, ready.max_num_seqs
        self.max_num_batched_tokens = ready.max_num_batched_tokens

    def apply_stats(self, stats: cbserve_pb2.CoreStats) -> None:
        self._refreshed_at = time.monotonic()
        self.snapshot = EngineStats(
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            prefill_queue_tokens=stats.prefill_queue_tokens, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_ratio=stats.prefix_cache_hit_ratio, num_preemptions=stats.num_preemptions,
            step_seconds_ewma=stats.step_seconds_ewma, prefill_tokens_per_second=stats.prefill_tokens_per_second,
            num_steps=stats.num_steps, lora_adapters=lora_stats_from_pb(stats.lora_adapters),
            max_loras=stats.max_loras,
            spec_decode=spec_stats_from_pb(stats.spec_decode) if stats.HasField("spec_decode") else None)
        self.num_held = stats.num_held_kv
        self.metrics.update(self.snapshot, self.num_held)
        # StepSample messages read like engine.outputs.StepSample (load reports, the stall threshold)
        self._samples = [(stats.first_sample_step + i, s) for i, s in enumerate(stats.samples)]


class EngineCoreClient(Subscribers):
    def __init__(self, runtime: CoreRuntime, service_name: str) -> None:
        super().__init__()
        self.rt = runtime
        self.service_name = service_name
        self.loop = asyncio.get_running_loop()
        self.last_iteration_at = time.monotonic()
        self.proc: subprocess.Popen | None = None
        self.pulls: dict[str, asyncio.Queue] = {}   # request id -> its PullKV stream's CorePullChunks
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._stopping = False
        self._exited = False
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        self._done.set_result(None)

    async def start(self, argv: list[str]) -> None:
        """Start the engine-core process and wait until its engine is loaded and warm."""
        ours, theirs = socket.socketpair()
        for sock in (ours, theirs):   # a prefill pod's KV chunks go through in one write (capped by the kernel)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cbserve.cli", *argv, "--engine-core-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        await self.connect(ours)

    async def connect(self, sock: socket.socket) -> None:
        """Talk to the engine core at the other end of `sock`; wait for its `ready`."""
        self._ready = self.loop.create_future()
        self.transport, _ = await self.loop.create_unix_connection(
            lambda: FrameReader(self._on_frame, self._on_closed), sock=sock)
        try:
            await self._ready
        except ConnectionError:
            raise EngineCoreExited(await asyncio.to_thread(self.proc.wait) if self.proc else 1) from None

    # ------------------------------------------------------------------ what EngineLoop offers
    def add(self, request: cbserve_pb2.GenerateRequest, timeout: float) -> concurrent.futures.Future:
        """Queue `request` in the engine core (its refusal arrives as the request's failure)."""
        command = cbserve_pb2.CoreCommand()
        command.add.CopyFrom(request)
        command.add.timeout_seconds = timeout
        self._send(command)
        return self._done

    def prefill(self, request: cbserve_pb2.PrefillRequest, timeout: float) -> None:
        """Queue `request` in a prefill pod's engine core (its refusal arrives as its failure)."""
        command = cbserve_pb2.CoreCommand(timeout_seconds=timeout)
        command.prefill.CopyFrom(request)
        self._send(command)

    def pull(self, request: cbserve_pb2.PullKVRequest, timeout: float) -> asyncio.Queue:
        """Start a prefill pod's KV pull in the engine core: the queue gets its `CorePullChunk`s, the
        last with `end` set. Call `end_pull` when the stream is over."""
        chunks = self.pulls[request.request_id] = asyncio.Queue()
        command = cbserve_pb2.CoreCommand(timeout_seconds=timeout)
        command.pull.CopyFrom(request)
        self._send(command)
        if self._exited:
            chunks.put_nowait(self._lost_pull(request.request_id))
        return chunks

    def end_pull(self, request_id: str, early: bool) -> None:
        """The pull's stream is over; `early`: before its last chunk (the core stops sending)."""
        self.pulls.pop(request_id, None)
        if early:
            self._send(cbserve_pb2.CoreCommand(end_pull_request_id=request_id))

    def call(self, command: cbserve_pb2.CoreCommand) -> concurrent.futures.Future:
        """Send `command` with a call id; the future gets the core's `CoreReply`."""
        command.call_id = next(self._call_ids)
        reply = self._calls[command.call_id] = concurrent.futures.Future()
        self._send(command)
        if self._exited:
            self._lose_calls()
        return reply

    def abort(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Abort `request_id` in the engine core; the future says whether it was open there."""
        found: concurrent.futures.Future[bool] = concurrent.futures.Future()
        reply = self.call(cbserve_pb2.CoreCommand(abort_request_id=request_id))
        reply.add_done_callback(lambda r: found.set_result(r.result().found))
        return found

    def fail(self, request_id: str, error: BaseException) -> None:
        self.loop.call_soon(self._deliver, request_id, error)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the engine core (after the drain) and wait for it to exit."""
        self._stopping = True
        self._send(cbserve_pb2.CoreCommand(stop=True))
        if self.proc is None:   # a core in this process (`connect`): its `run()` returns
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine-core process did not stop in %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.wait()

    # ------------------------------------------------------------------ engine core's messages
    def _send(self, command: cbserve_pb2.CoreCommand) -> None:
        if not self.transport.is_closing():
            self.transport.write(frame(command))

    def _on_frame(self, data: bytes | bytearray) -> None:
        events = cbserve_pb2.CoreEvents.FromString(data)
        if not self._ready.done():   # the first message: the engine is loaded and warm
            self.rt.apply_ready(events.ready)
            self._ready.set_result(None)
        self._apply(events)

    def _on_closed(self) -> None:
        if not self._ready.done():
            self._ready.set_exception(ConnectionError("the engine core closed its socket before it was ready"))
        else:
            self._closed = asyncio.ensure_future(self._core_closed())

    def _apply(self, events: cbserve_pb2.CoreEvents) -> None:
        rt = self.rt
        if events.iteration_at > self.last_iteration_at:
            self.last_iteration_at = events.iteration_at
        for seconds in events.step_seconds:
            rt.metrics.step.observe(seconds)
        if events.HasField("stats"):
            rt.apply_stats(events.stats)
        subscribers = self._subscribers
        for out in events.outputs:
            deliver = subscribers.get(out.request_id)
            if deliver is not None:
                deliver(out)
        if events.token_request_ids:
            tokens, start = list(events.token_ids), 0
            for request_id, count in zip(events.token_request_ids, events.num_new_tokens):
                deliver = subscribers.get(request_id)
                if deliver is not None:
                    deliver(NewTokens(tokens[start:start + count]))
                start += count
        for reply in events.replies:
            future = self._calls.pop(reply.call_id, None)
            if future is not None:
                future.set_result(reply)
        for chunk in events.pull_chunks:
            chunks = self.pulls.get(chunk.request_id)
            if chunks is not None:
                chunks.put_nowait(chunk)
        if events.lease_expiries:
            rt.metrics.lease_expiries.inc(events.lease_expiries)
        if events.HasField("structured_outputs"):
            rt.metrics.structured_outputs(events.structured_outputs)
        for error in events.errors:
            code = STATUS_CODES.get(error.code, grpc.StatusCode.INTERNAL)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                rt.metrics.rejected("invalid")
            self._deliver(error.request_id, RequestFailed(code, error.message))

    async def _core_closed(self) -> None:
        if self._stopping:   # stopped after the drain: nothing is open, but answer any late call
            self._exited, self._why = True, f"{self.rt.role_label} pod {self.rt.pod_id} stopped"
            self._lose_calls()
            return
        code = await asyncio.to_thread(self.proc.wait) if self.proc else 1
        log.error("the engine-core process exited with code %s: failing %d requests and %d KV pulls; the pod exits",
                  code, len(self._subscribers), len(self.pulls))
        self.rt.set_serving(False, self.service_name)
        self._stopping = self._exited = True
        self._why = f"{self.rt.role_label} pod {self.rt.pod_id}: its engine process exited ({code})"
        for request_id in list(self._subscribers):
            self._deliver(request_id, RequestFailed(grpc.StatusCode.UNAVAILABLE, self._why))
        for request_id, chunks in self.pulls.items():
            chunks.put_nowait(self._lost_pull(request_id))
        self._lose_calls()
        self.rt.stop(exit_code=code if code and code > 0 else 1)

    def _lost_pull(self, request_id: str) -> cbserve_pb2.CorePullChunk:
        return cbserve_pb2.CorePullChunk(request_id=request_id, end=True, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                         message=self._why)

    def _lose_calls(self) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_result(cbserve_pb2.CoreReply(code=grpc.StatusCode.UNAVAILABLE.value[0], message=self._why))
