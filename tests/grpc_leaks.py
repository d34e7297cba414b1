"""Finding grpc.aio channels and servers that outlive the event loop they were made on.

A grpc.aio object is bound to the loop it was created on: grpc's poller thread hands it every
event (a reply, a connectivity change, a GOAWAY) with `loop.call_soon_threadsafe`. One left open
when its test's loop closes gets `RuntimeError: Event loop is closed` at some later event, raised
in whatever test runs then (a new fake pod reusing its port and going away sends it a GOAWAY), and
that test fails for nothing it did.

`track()` records every channel and server as it is made; `open_on_stopped_loops()` names those
still open whose loop no longer runs. The records are strong until that check: a channel dropped
unclosed closes itself in `__del__`, but only once nothing refers to it, and one caught in a
reference cycle (a task, a traceback) stays open until a garbage collection, which is the leak.
Objects on a loop that still runs (a module fixture's `LoopThread`) are their owner's to close;
they are checked again, weakly, once their loop stopped.

A closed channel can still have events on their way: `Channel.close()` cancels the calls in flight
and returns, and their completions come some milliseconds later through grpc's one poller for the
process (measured: a call in flight, `await channel.close()`, the loop closed at once: one stale
event; 50 ms of loop after the close: none). A test whose loop ends inside that window leaves them
to the next test's loop, where delivering them raises `Event loop is closed` (CI, once in
`test_router_pod_trust.py` on a 2-core machine). Nothing waits for such an event any more, so
`ignore_stale_events()` makes the suite's async tests (anyio's runner) warn about it instead of
failing; an open channel or server on a stopped loop, the leak, still fails its own test.
"""

from __future__ import annotations

import warnings
import weakref

import grpc.aio._channel
import grpc.aio._server

_made: list = []                                  # since the last check
_on_running_loops: weakref.WeakSet = weakref.WeakSet()


def track() -> None:
    """Record every grpc.aio Channel and Server made from now on (idempotent)."""
    for cls in (grpc.aio._channel.Channel, grpc.aio._server.Server):
        if getattr(cls.__init__, "_tracked", False):
            continue
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            _made.append(self)

        init._tracked = True
        cls.__init__ = init


def _describe(obj) -> str:
    if isinstance(obj, grpc.aio._channel.Channel):
        return f"grpc.aio channel to {obj._channel.target.decode(errors='replace')}"
    return f"grpc.aio server {hex(id(obj))}"


def _open(obj) -> bool:
    if isinstance(obj, grpc.aio._channel.Channel):
        return not obj._channel.closed()
    return obj._server.is_running()           # False once stop() finished (or before start())


def open_on_stopped_loops() -> list[str]:
    """The channels and servers made since the last call (or on a loop that was running then)
    that are still open although their event loop is closed or no longer running."""
    candidates = [*_made, *_on_running_loops]
    _made.clear()
    found = []
    for obj in candidates:
        _on_running_loops.discard(obj)
        if not _open(obj):
            continue
        if obj._loop.is_running():
            _on_running_loops.add(obj)
        else:                                  # named once: the test that leaked it fails, no later one
            found.append(_describe(obj))
            if isinstance(obj, grpc.aio._channel.Channel):
                obj._channel.close()          # as its `__del__` would: no more events for the dead loop
    return found


class StaleGrpcEvent(UserWarning):
    """A grpc completion for a call whose event loop had already closed, seen by a later loop."""


def is_stale_event(context: dict) -> bool:
    """Whether an asyncio exception-handler context is grpc's poller failing to hand an event to
    a closed loop (the only `Event loop is closed` that `_handle_events` raises)."""
    exc = context.get("exception")
    return (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
            and "PollerCompletionQueue._handle_events" in repr(context.get("handle")))


def ignore_stale_events() -> None:
    """anyio's test runner (which fails a test for any exception in a loop callback) warns about
    a stale grpc event instead (idempotent)."""
    from anyio._backends._asyncio import TestRunner

    original = TestRunner._exception_handler
    if getattr(original, "_stale_events_ignored", False):
        return

    def handler(self, loop, context):
        if is_stale_event(context):
            warnings.warn(StaleGrpcEvent("a grpc event for a call of an earlier, closed event loop "
                                         "(a channel closed with calls in flight just before its loop ended)"))
            return
        original(self, loop, context)

    handler._stale_events_ignored = True
    TestRunner._exception_handler = handler
