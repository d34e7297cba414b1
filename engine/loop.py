"""Runs an `Engine` in its own thread and connects it to asyncio servers.

The engine is single-threaded by design; servers live on an event loop. Everything that touches
the engine runs in the engine thread, between steps: callers submit functions (`call`); each
step's outputs go back to their subscribers in one `call_soon_threadsafe`: a per-request asyncio
queue that the subscriber takes with `drain` (everything queued at once, not one wake per token),
or a callback; or, with a `sink`, to it directly from the engine thread (a decode pod's engine
core builds one message per step for its server process). A step that raises fails the requests
it touched, not the process: one bad request never kills the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.engine import Engine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_SECONDS = 0.05
# TEST FAULT HOOK, never set in production: while the file this variable names exists, the engine
# thread hangs before each step, as it would on a stuck device or a hung kernel, and the rest of
# the process (gRPC, health, load reports) keeps running. Tests stall the engine thread alone
# with it; SIGSTOP can only freeze a whole process.
FAULT_STALL_FILE_ENV = "CBSERVE_TEST_FAULT_STALL_FILE"


async def drain(outputs: asyncio.Queue) -> list:
    """Waits for a subscriber's next item, then takes every item already queued with it.

    A consumer that handles the whole list per wake costs the event loop one wake per engine step
    (a step's outputs arrive in one callback), and fewer when it falls behind."""
    items = [await outputs.get()]
    while not outputs.empty():
        items.append(outputs.get_nowait())
    return items


class Subscribers:
    """Where each request's outputs go on the event loop: `subscribe` (a queue) or `subscribe_with`
    (a callback), until `unsubscribe`. Shared by `EngineLoop` (the engine in this process) and a
    pod's `EngineCoreClient` (the engine in its engine-core process), which supply `abort`."""

    def __init__(self) -> None:
        self._subscribers: dict[str, Callable[[Any], None]] = {}

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """Outputs of `request_id` (call before the request is added, from the event loop)."""
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers[request_id] = q.put_nowait
        return q

    def subscribe_with(self, request_id: str, deliver: Callable[[Any], None]) -> None:
        """As `subscribe`, with `deliver(item)` called on the event loop for each output or failure."""
        self._subscribers[request_id] = deliver

    def is_subscribed(self, request_id: str) -> bool:
        return request_id in self._subscribers

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    def _deliver(self, request_id: str, item: Any) -> None:
        deliver = self._subscribers.get(request_id)
        if deliver is not None:
            deliver(item)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        raise NotImplementedError

    def fail_all(self, error: Callable[[], BaseException]) -> list[str]:
        """Event loop: end every subscribed request now with `error()` and abort it in the engine
        (which drops it when its thread next runs commands). For a stuck engine thread
        (`pod.stall`): its requests fail over to other pods in seconds instead of waiting for it.
        Returns their ids."""
        request_ids = list(self._subscribers)
        for request_id in request_ids:
            self._deliver(request_id, error())
            self.abort(request_id)
        return request_ids


class EngineLoop(Subscribers):
    """`post_step(engine, outputs)` runs in the engine thread after every step (pods use it to
    publish KV progress); `on_idle(engine)` runs at least every 50 ms (TTL expiry).

    With a `sink`, outputs and failures go to it instead of to subscribers on the event loop:
    `sink.outputs(list)` in the engine thread after each step, `sink.failure(request_id, error)`
    from either thread (a decode pod's engine-core process sends them to its server process)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 post_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
                 on_idle: Callable[[Engine], None] | None = None, sink: Any = None) -> None:
        super().__init__()
        self.engine = engine
        self.loop = loop
        self.post_step = post_step
        self.on_idle = on_idle
        self.sink = sink
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Monotonic time the engine thread last went round its loop (at least every 50 ms while it
        # is alive and not inside a step or a command): how pods tell a stalled engine (`PodRuntime`).
        self.last_iteration_at = time.monotonic()
        self._fault_stall_file = os.environ.get(FAULT_STALL_FILE_ENV) or None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put((lambda e: None, concurrent.futures.Future()))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ asyncio side
    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` in the engine thread before its next step."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return fut

    async def run(self, fn: Callable[[Engine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def abort(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Abort `request_id` in the engine (idempotent; frees its blocks) before the next step."""
        return self.call(lambda engine: engine.abort(request_id))

    # ------------------------------------------------------------------ engine thread

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand outputs to their subscribers."""
        if self.sink is not None:
            self.sink.outputs(outputs)
        elif outputs:
            self.loop.call_soon_threadsafe(self._publish_now, outputs)

    def fail(self, request_id: str, error: BaseException) -> None:
        if self.sink is not None:
            self.sink.failure(request_id, error)
        else:
            self.loop.call_soon_threadsafe(self._deliver, request_id, error)

    def _publish_now(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        last_idle = 0.0
        while not self._stop.is_set():
            self.last_iteration_at = time.monotonic()
            # Busy only while the last step did work: requests that wait for remote KV or for
            # blocks make no progress until a command (KV landed, abort) arrives.
            last = self.engine.last_schedule
            busy = self.engine.has_unfinished_requests() and (last is None or bool(last.scheduled))
            self._run_commands(block=not busy)
            now = time.monotonic()
            if self.on_idle is not None and now - last_idle >= IDLE_WAIT_SECONDS:
                last_idle = now
                self._guard(self.on_idle, self.engine)
            if not self.engine.has_unfinished_requests():
                self.engine.last_schedule = None
                continue
            if self._fault_stall_file is not None:
                self._fault_stall()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed; aborting the requests it scheduled")
                self._fail_running(e)
                continue
            if self.post_step is not None:
                self._guard(self.post_step, self.engine, outputs)
            self.publish(outputs)
            for request_id, error in self.engine.take_failures():   # e.g. a grammar that failed
                self.fail(request_id, error)

    def _fault_stall(self) -> None:
        """TEST FAULT HOOK (see FAULT_STALL_FILE_ENV): hang while the file exists."""
        while os.path.exists(self._fault_stall_file) and not self._stop.is_set():
            time.sleep(0.05)

    def _guard(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("engine loop hook %s failed", getattr(fn, "__name__", fn))

    def _fail_running(self, error: Exception) -> None:
        scheduler = self.engine.scheduler
        failed = dict.fromkeys(self.engine.drop_in_flight())
        failed.update(dict.fromkeys(req.request_id for req in scheduler.running))
        for request_id in failed:
            self.engine.abort(request_id)
            self.fail(request_id, RuntimeError(f"engine step failed: {error}"))
