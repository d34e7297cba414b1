"""The suite's check for grpc.aio channels and servers left open after their event loop stopped
(`tests/grpc_leaks.py`, run after every test by `tests/conftest.py`), and its tolerance of a
closed loop's late grpc event in a later test."""

import asyncio
import socket
import threading

import grpc
import pytest
from anyio._backends import _asyncio as anyio_asyncio

from tests import grpc_leaks


def test_an_open_channel_on_a_closed_loop_is_named_once_and_closed():
    grpc_leaks.open_on_stopped_loops()                 # what earlier fixtures made is not this test's

    async def leak():
        return grpc.aio.insecure_channel("127.0.0.1:9")

    async def clean():
        async with grpc.aio.insecure_channel("127.0.0.1:10"):
            pass

    channel = asyncio.run(leak())
    asyncio.run(clean())
    assert grpc_leaks.open_on_stopped_loops() == ["grpc.aio channel to 127.0.0.1:9"]
    assert channel._channel.closed()                   # closed by the check: no event for the dead loop
    assert grpc_leaks.open_on_stopped_loops() == []


def test_a_channel_on_a_loop_that_still_runs_is_checked_once_that_loop_stopped():
    grpc_leaks.open_on_stopped_loops()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()

    async def make():
        return grpc.aio.insecure_channel("127.0.0.1:11")

    channel = asyncio.run_coroutine_threadsafe(make(), loop).result(10)
    assert grpc_leaks.open_on_stopped_loops() == []    # a module fixture's LoopThread: its owner closes it
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    assert grpc_leaks.open_on_stopped_loops() == ["grpc.aio channel to 127.0.0.1:11"]
    loop.close()
    del channel


def _stale_event_contexts() -> tuple[list[dict], object, int]:
    """A call in flight to a silent peer when its loop ends: its completion (a 0.5 s deadline)
    comes after the loop closed, and reaches a later loop. That loop's exception-handler
    contexts, the call's task (kept: a pending task logs when it is collected) and the peer's port."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]

    async def end_with_a_call_in_flight():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        task = asyncio.ensure_future(channel.unary_unary("/x.Y/Z")(b"", timeout=0.5))
        await asyncio.sleep(0.2)
        return task

    seen: list[dict] = []

    async def later_test():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context))
        async with grpc.aio.insecure_channel("127.0.0.1:10"):
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.05)

    loop = asyncio.new_event_loop()
    try:
        task = loop.run_until_complete(end_with_a_call_in_flight())
        loop.close()
        asyncio.run(later_test())
    finally:
        silent.close()
    return seen, task, port


def test_a_stale_grpc_event_warns_in_a_later_async_test_and_other_errors_still_fail_it():
    grpc_leaks.open_on_stopped_loops()
    seen, _task, port = _stale_event_contexts()
    assert seen and all(grpc_leaks.is_stale_event(context) for context in seen)
    with anyio_asyncio.TestRunner() as runner:      # the runner of the suite's async tests
        loop = runner.get_loop()
        with pytest.warns(grpc_leaks.StaleGrpcEvent):
            runner._exception_handler(loop, seen[0])
        assert not runner._exceptions                  # the later test does not fail for it
        other = {"message": "boom", "exception": RuntimeError("Event loop is closed"), "handle": None}
        runner._exception_handler(loop, other)
        assert runner._exceptions == [other["exception"]]
        runner._exceptions.clear()
    # The channel left open on its closed loop is still the leak, named once.
    assert grpc_leaks.open_on_stopped_loops() == [f"grpc.aio channel to 127.0.0.1:{port}"]
