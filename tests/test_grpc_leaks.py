"""The suite's check for grpc.aio channels and servers left open after their event loop stopped
(`tests/grpc_leaks.py`, run after every test by `tests/conftest.py`)."""

import asyncio
import threading

import grpc

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
