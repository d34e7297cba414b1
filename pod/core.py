"""A pod's engine-core process: the engine, its thread and everything that touches its KV cache,
apart from the pod's gRPC server.

The pod's server process (`pod.core_client`) keeps the gRPC server, each request's bookkeeping,
metrics and health; this process keeps the engine thread (`engine.loop.EngineLoop`) and, on its
event loop, the commands the server sends and the KV transfers (a decode pod's pulls write into
the cache, a prefill pod's reads from it). So the per-request and per-token Python of the server
(gRPC handlers, building each request's response, grpc.aio's own send path) runs on another
interpreter and never holds the engine's GIL, and it runs while the engine computes the next step
instead of after it; the engine-core side of a step is one `CoreEvents` message, queued by the
engine thread and built and written by a writer thread. vLLM V1 splits its API server from its
engine core the same way; like vLLM's KV connectors, the KV transfers stay with the engine, so the
KV cache is never shared across processes, NCCL groups live beside the memory they move, and
tensor-parallel pods gather and scatter KV in their rank-0 process as before.

Protocol (`CoreCommand` in, `CoreEvents` out): frames over a socketpair the server created and
passed as a file descriptor (`--engine-core-fd`); each frame is a 4-byte little-endian length and a
protobuf message. Nothing is pickled. The first message out is `ready` (model loaded and warm).
While idle the engine thread still sends a message every 50 ms (statistics, `iteration_at`): the
server's stall watch reads the engine thread's liveness from it. A command with a `call_id` gets a
`CoreReply`. This process exits when the server says `stop` or its end of the socket closes (the
server died), and ignores SIGINT and SIGTERM: the server drains first, then stops it.

`EngineCore` is what both roles share; `decode_pod.core.DecodeCore` and
`prefill_pod.core.PrefillCore` add their commands and what a step's outputs say.
"""

from __future__ import annotations

import asyncio
import gc
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

from wire import cbserve_pb2
from engine.engine import Engine
from engine.grammar.stats import structured_stats_to_pb
from engine.loop import EngineLoop
from engine.outputs import RequestOutput
from engine.spec_decode.metrics import stats_to_pb as spec_stats_to_pb
from engine.lora.stats import stats_to_pb as lora_stats_to_pb
from pod.lora import LORA_COMMANDS, lora_command
from pod.runtime import PodRuntime, RequestFailed

log = logging.getLogger(__name__)
FRAME = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
BIG_FRAME_BYTES = 256 << 10   # the server's read buffer; a larger frame is read into its own


def frame(message) -> bytes:
    data = message.SerializeToString()
    return FRAME.pack(len(data)) + data


def send_frame(sock: socket.socket, message) -> None:
    """Write `message` as one frame on a blocking socket (a large one without a joined copy)."""
    data = message.SerializeToString()
    header = FRAME.pack(len(data))
    if len(data) < BIG_FRAME_BYTES:
        sock.sendall(header + data)
        return
    sent = sock.sendmsg([header, data])   # one write, no joined copy; the rest if it was cut short
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(data):
        sock.sendall(memoryview(data)[sent - len(header):])


class FrameReader(asyncio.BufferedProtocol):
    """The server's end of an engine core's socket: calls `on_frame(message bytes)` for each frame
    as it completes, then `on_closed()` once the connection is gone. Reads go into one buffer, many
    small frames per read (a step's message is small); a frame larger than that buffer is read
    straight into a buffer of its own size (a prefill pod's KV chunks), so its bytes are copied
    once out of the kernel, not appended and sliced."""

    def __init__(self, on_frame: Callable[[bytes | bytearray], None], on_closed: Callable[[], None],
                 buffer_bytes: int = BIG_FRAME_BYTES) -> None:
        self._on_frame, self._on_closed = on_frame, on_closed
        self._buf = bytearray(buffer_bytes)
        self._start = self._end = 0           # unread bytes: _buf[_start:_end]
        self._big: bytearray | None = None    # a large frame being read, and how much of it is here
        self._big_pos = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_pos:]
        if self._end == len(self._buf):   # full: move what is unread to the front
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start:self._end]
            self._start, self._end = 0, unread
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_pos += nbytes
            if self._big_pos == len(self._big):
                big, self._big = self._big, None
                self._on_frame(big)
            return
        self._end += nbytes
        buf = self._buf
        while self._end - self._start >= FRAME.size:
            (size,) = FRAME.unpack_from(buf, self._start)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"engine-core frame of {size} bytes")
            body = self._start + FRAME.size
            if self._end - body >= size:
                self._start = body + size
                self._on_frame(bytes(memoryview(buf)[body:body + size]))
            elif size > len(buf) - FRAME.size:   # will not fit: read the rest into a buffer of its own
                self._big = bytearray(size)
                self._big_pos = self._end - body
                self._big[:self._big_pos] = buf[body:self._end]
                self._start = self._end = 0
                return
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def eof_received(self) -> bool:
        return False   # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_closed()


def stats_to_pb(stats, samples: list, message: cbserve_pb2.CoreStats, num_held: int = 0) -> None:
    """`EngineStats`, numbered step samples [(step, StepSample)] and the count of held KV into `message`."""
    message.num_running, message.num_waiting = stats.num_running, stats.num_waiting
    message.prefill_queue_tokens = stats.prefill_queue_tokens
    message.num_free_blocks, message.num_total_blocks = stats.num_free_blocks, stats.num_total_blocks
    message.kv_cache_usage, message.prefix_cache_hit_ratio = stats.kv_cache_usage, stats.prefix_cache_hit_ratio
    message.num_preemptions, message.num_steps = stats.num_preemptions, stats.num_steps
    message.step_seconds_ewma = stats.step_seconds_ewma
    message.prefill_tokens_per_second = stats.prefill_tokens_per_second
    message.num_held_kv = num_held
    if stats.spec_decode is not None:
        spec_stats_to_pb(stats.spec_decode, message.spec_decode)
    message.max_loras = stats.max_loras
    lora_stats_to_pb(stats.lora_adapters, message.lora_adapters)
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
                send_frame(self._sock, events)
            except OSError:   # the server is gone; the command reader sees it too and exits
                return


class EngineCore:
    """The engine core of one pod: `run()` serves commands until told to stop. Subclasses answer
    their role's commands (`command`) and say what a step's outputs are on the wire (`fill_outputs`)."""

    def __init__(self, runtime: PodRuntime, sock: socket.socket) -> None:
        self.rt = runtime
        self.sock = sock
        self.outbox = Outbox(sock)
        self._steps_sent = 0
        self._stats_sent_at = 0.0

    # ------------------------------------------------------------------ engine thread
    def post_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        self.rt.after_step(engine)

    def on_idle(self, engine: Engine) -> None:
        self.rt.refresh(engine, self.rt.num_held)
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
            stats = (rt.snapshot, rt._samples, rt.num_held)
        iteration_at = rt.loop.last_iteration_at
        extra = self.step_extras()
        structured = engine.structured.take_stats()
        self.outbox.put(lambda events: self._fill(events, outputs, steps, stats, iteration_at, extra, structured))

    def step_extras(self):
        """Engine thread: anything else this step's message carries (passed to `fill_outputs`)."""
        return None

    def failure(self, request_id: str, error: BaseException) -> None:
        """`EngineLoop` sink, either thread: `request_id` ended with `error`."""
        self.send_error(request_id, error)
        self.rt.loop.loop.call_soon_threadsafe(self.forget, request_id)

    def send_error(self, request_id: str, error: BaseException) -> None:
        """End `request_id`'s call at the server with `error` (either thread)."""
        # A ValueError here is the request's own (a grammar that does not compile): INVALID_ARGUMENT.
        code = error.code if isinstance(error, RequestFailed) else (
            grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, ValueError) else grpc.StatusCode.INTERNAL)

        def fill(events: cbserve_pb2.CoreEvents) -> None:
            events.errors.add(request_id=request_id, code=code.value[0], message=str(error))
        self.outbox.put(fill)

    def _fill(self, events: cbserve_pb2.CoreEvents, outputs: list[RequestOutput], steps: list[float],
              stats, iteration_at: float, extra, structured) -> None:
        """Writer thread: one step's message."""
        self.fill_outputs(events, outputs, extra)
        structured_stats_to_pb(structured, events)
        events.step_seconds.extend(steps)
        if stats is not None:
            stats_to_pb(*stats[:2], events.stats, num_held=stats[2])
        events.iteration_at = iteration_at

    def fill_outputs(self, events: cbserve_pb2.CoreEvents, outputs: list[RequestOutput], extra) -> None:
        """Writer thread: a step's outputs into `events`."""
        raise NotImplementedError

    def reply(self, call_id: int, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "",
              found: bool = False) -> None:
        """Answer the command `call_id` (either thread; no-op for a command without one)."""
        if call_id:
            self.outbox.put(lambda events: events.replies.add(call_id=call_id, code=code.value[0],
                                                              message=message, found=found))

    # ------------------------------------------------------------------ commands (event loop)
    def forget(self, request_id: str) -> None:
        """Event loop: `request_id` is over here (finished, failed or aborted)."""

    def command(self, kind: str, command: cbserve_pb2.CoreCommand) -> None:
        """Event loop: a role's own command."""
        raise NotImplementedError

    def abort(self, request_id: str, call_id: int) -> None:
        """Event loop: abort `request_id` in the engine (frees its KV) and reply whether it was open."""
        self.forget(request_id)
        aborted = self.rt.loop.abort(request_id)
        aborted.add_done_callback(lambda f: self.reply(call_id, found=bool(f.exception() is None and f.result())))

    async def run(self) -> None:
        rt = self.rt
        rt.warm_up()
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        rt.loop = EngineLoop(rt.engine, loop, post_step=self.post_step, on_idle=self.on_idle, sink=self)
        ready = cbserve_pb2.CoreEvents()
        ready.ready.model.CopyFrom(rt.model_info)
        ready.ready.block_size, ready.ready.max_num_seqs = rt.block_size, rt.max_num_seqs
        ready.ready.max_num_batched_tokens = rt.max_num_batched_tokens
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
            try:   # a server that died with our messages unread resets the connection: gone too
                header = reader.read(FRAME.size)
                (size,) = FRAME.unpack(header)
                data = reader.read(size)
                if len(data) < size:
                    raise EOFError
            except (OSError, struct.error, EOFError):
                log.warning("the %s pod's server process is gone; the engine core exits", self.rt.role_label)
                os._exit(1)
            command = cbserve_pb2.CoreCommand.FromString(data)
            loop.call_soon_threadsafe(self._command, command)
            if command.WhichOneof("kind") == "stop":
                return

    def _command(self, command: cbserve_pb2.CoreCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "abort_request_id":
            self.abort(command.abort_request_id, command.call_id)
        elif kind == "stop":
            self._stopped.set()
        elif kind in LORA_COMMANDS:
            lora_command(self, kind, command)
        else:
            self.command(kind, command)


def run_core(core_class: type[EngineCore], runtime: PodRuntime, fd: int) -> int:
    """Entry point of an engine-core process (`cbserve decode|prefill ... --engine-core-fd FD`)."""
    for sig in (signal.SIGINT, signal.SIGTERM):   # the server drains, then says stop
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    asyncio.run(core_class(runtime, sock).run())
    return 0
