"""The server side of a decode pod's engine core (`decode_pod.core`): where the engine lives for
the pod's gRPC server.

`CoreRuntime` is the pod runtime without an engine of its own: it starts the engine-core process
before the server listens, takes the model's description from its `ready` message, and keeps the
statistics and step samples the core sends (load reports and metrics read them, as they read the
engine thread's snapshot in a pod with its engine in-process). `EngineCoreClient` stands where
`engine.loop.EngineLoop` stands in such a pod: requests go out as commands; each `CoreEvents`
message costs the event loop one wake, and hands every request's `CoreOutput`s to its subscriber.

If the engine core exits, every open request fails with UNAVAILABLE (the router retries it
elsewhere), the pod reports NOT_SERVING and exits with the core's exit code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from wire import cbserve_pb2
from decode_pod.core import frame, read_frame
from engine.loop import Subscribers
from engine.outputs import EngineStats
from pod.runtime import PodRuntime, RequestFailed

log = logging.getLogger(__name__)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
ROOT = Path(__file__).resolve().parent.parent
STOP_SECONDS = 10.0


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
    """A decode pod's runtime whose engine runs in an engine-core process (`argv`: the pod's
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

    def apply_stats(self, stats: cbserve_pb2.CoreStats) -> None:
        self._refreshed_at = time.monotonic()
        self.snapshot = EngineStats(
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            prefill_queue_tokens=stats.prefill_queue_tokens, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_ratio=stats.prefix_cache_hit_ratio, num_preemptions=stats.num_preemptions,
            step_seconds_ewma=stats.step_seconds_ewma, prefill_tokens_per_second=stats.prefill_tokens_per_second,
            num_steps=stats.num_steps)
        self.metrics.update(self.snapshot, 0)
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
        self._stopping = False
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        self._done.set_result(None)

    async def start(self, argv: list[str]) -> None:
        """Start the engine-core process and wait until its engine is loaded and warm."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cbserve.cli", *argv, "--engine-core-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.reader, self.writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        try:
            first = cbserve_pb2.CoreEvents.FromString(await read_frame(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise EngineCoreExited(await asyncio.to_thread(self.proc.wait)) from None
        self.rt.apply_ready(first.ready)
        self._apply(first)
        self._reading = asyncio.create_task(self._read())

    # ------------------------------------------------------------------ what EngineLoop offers
    def add(self, request: cbserve_pb2.GenerateRequest, timeout: float) -> concurrent.futures.Future:
        """Queue `request` in the engine core (its refusal arrives as the request's failure)."""
        command = cbserve_pb2.CoreCommand()
        command.add.CopyFrom(request)
        command.add.timeout_seconds = timeout
        self._send(command)
        return self._done

    def abort(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Abort `request_id` in the engine core; the future says whether it was open here."""
        self._send(cbserve_pb2.CoreCommand(abort_request_id=request_id))
        found: concurrent.futures.Future[bool] = concurrent.futures.Future()
        found.set_result(request_id in self._subscribers)
        return found

    def fail(self, request_id: str, error: BaseException) -> None:
        self.loop.call_soon(self._deliver, request_id, error)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the engine core (after the drain) and wait for it to exit."""
        self._stopping = True
        self._send(cbserve_pb2.CoreCommand(stop=True))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine-core process did not stop in %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.wait()

    # ------------------------------------------------------------------ engine core's messages
    def _send(self, command: cbserve_pb2.CoreCommand) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(command))

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
        for error in events.errors:
            code = STATUS_CODES.get(error.code, grpc.StatusCode.INTERNAL)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                rt.metrics.rejected("invalid")
            self._deliver(error.request_id, RequestFailed(code, error.message))

    async def _read(self) -> None:
        try:
            while True:
                self._apply(cbserve_pb2.CoreEvents.FromString(await read_frame(self.reader)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        if self._stopping:
            return
        code = await asyncio.to_thread(self.proc.wait)
        log.error("the engine-core process exited with code %s: failing %d requests; the pod exits",
                  code, len(self._subscribers))
        self.rt.set_serving(False, self.service_name)
        self._stopping = True
        for request_id in list(self._subscribers):
            self._deliver(request_id, RequestFailed(
                grpc.StatusCode.UNAVAILABLE, f"decode pod {self.rt.pod_id}: its engine process exited ({code})"))
        self.rt.stop(exit_code=code if code and code > 0 else 1)
