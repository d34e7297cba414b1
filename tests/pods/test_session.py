"""A decode pod's Session against a real pod process: many requests on one stream.

Outputs equal per-request `Generate`; one message carries every request that moved in a step;
a bad request fails alone; cancelling a request, or closing the whole session, frees its KV;
an idle session hears heartbeats; a frozen pod fails its open requests with UNAVAILABLE within
the router's inactivity limit instead of hanging.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest

from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from router.pod_session import DecodeSession
from tests.pods.podproc import Pod, pod_channel, run, sampling

pytestmark = pytest.mark.slow


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(4, 260) for _ in range(n - 1)]


@pytest.fixture(scope="module")
def pod():
    pod = Pod("decode")
    try:
        pod.wait_ready()
        pod.idle_free_blocks = pod.load().num_free_blocks
        yield pod
    finally:
        pod.stop()


def request(req_id: str, seed: int, max_tokens: int = 12, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=req_id, prompt_token_ids=prompt(20 + seed, seed),
                              sampling=sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw))


async def read_all(call) -> list[int]:
    tokens = []
    while True:
        message = await call.read()
        tokens += message.token_ids
        if message.finished:
            return tokens


def test_session_outputs_equal_generate_and_share_messages(pod):
    async def scenario():
        async with pod_channel(pod.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            want = {}
            for i in range(6):
                want[f"g{i}"] = [t async for m in stub.Generate(request(f"g{i}", i), timeout=60) for t in m.token_ids]
            # Raw stream: every request of a step travels in one message.
            outbox: asyncio.Queue = asyncio.Queue()
            for i in range(6):
                outbox.put_nowait(pb.SessionRequest(generate=request(f"s{i}", i)))

            async def requests():
                while (m := await outbox.get()) is not None:
                    yield m

            got: dict[str, list[int]] = {f"s{i}": [] for i in range(6)}
            widest, finished = 0, 0
            call = stub.Session(requests())
            first = await call.read()
            assert first.heartbeat_seconds > 0
            while finished < 6:
                message = await asyncio.wait_for(call.read(), 60)
                assert not message.errors
                widest = max(widest, len(message.outputs))
                for out in message.outputs:
                    got[out.request_id] += out.token_ids
                    finished += out.finished
            outbox.put_nowait(None)
            call.cancel()
            assert {k[1:]: v for k, v in got.items()} == {k[1:]: v for k, v in want.items()}
            assert widest > 1, "a step's outputs for several requests should share one message"

    run(scenario())
    pod.wait_free_blocks(pod.idle_free_blocks, timeout=10)


def test_bad_request_fails_alone_and_cancel_frees_kv(pod):
    async def scenario():
        async with pod_channel(pod.address) as channel:
            session = DecodeSession(pb_grpc.DecodeServiceStub(channel), pod.address, inactivity_seconds=30)
            good = session.generate(request("ok", 1), timeout=60)
            bad = session.generate(pb.GenerateRequest(request_id="bad", prompt_token_ids=[1, 10**6],
                                                      sampling=sampling(max_tokens=4)), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bad.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            long = session.generate(request("long", 2, max_tokens=400), timeout=60)
            await long.read()
            # The same id while "long" is open: refused, on this session and on another one.
            other = DecodeSession(pb_grpc.DecodeServiceStub(channel), pod.address, inactivity_seconds=30)
            for dup in (session.generate(request("long", 3), timeout=60), other.generate(request("long", 3), 60)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await dup.read()
                assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            other.close()
            assert len(await read_all(good)) == 12
            long.cancel()
            await asyncio.sleep(0.2)
            assert not session.broken
            # Requests still open when the session closes are freed too.
            for i in range(3):
                await session.generate(request(f"open{i}", i, max_tokens=400), timeout=60).read()
            session.close()

    run(scenario())
    pod.wait_free_blocks(pod.idle_free_blocks, timeout=10)


def test_idle_session_hears_heartbeats(pod):
    async def scenario():
        async with pod_channel(pod.address) as channel:
            call = pb_grpc.DecodeServiceStub(channel).Session(_never())
            start = time.monotonic()
            heard = [await asyncio.wait_for(call.read(), 30) for _ in range(3)]
            call.cancel()
        assert all(not m.outputs and not m.errors for m in heard)
        assert time.monotonic() - start >= 1.0     # the first is immediate, then one per idle second

    run(scenario())


async def _never():
    await asyncio.Event().wait()
    yield pb.SessionRequest()


def test_frozen_pod_fails_open_requests_instead_of_hanging():
    pod = Pod("decode")
    try:
        pod.wait_ready()
        idle_free_blocks = pod.load().num_free_blocks

        async def scenario():
            async with pod_channel(pod.address) as channel:
                session = DecodeSession(pb_grpc.DecodeServiceStub(channel), pod.address, inactivity_seconds=2)
                call = session.generate(request("frozen", 1, max_tokens=2000), timeout=600)
                await call.read()
                pod.kill(signal.SIGSTOP)
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await asyncio.wait_for(call.read(), 60)
                waited = time.monotonic() - start
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "frozen" in err.value.details()
                assert waited < 15, f"a frozen pod held the request {waited:.1f}s"
                pod.kill(signal.SIGCONT)
                assert session.broken
        run(scenario())
        pod.wait_free_blocks(idle_free_blocks, timeout=15)   # the router's side closed: the pod freed it
    finally:
        pod.kill(signal.SIGCONT)
        pod.stop()

