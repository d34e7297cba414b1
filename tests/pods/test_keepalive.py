"""Keepalive: a frozen pod (SIGSTOP: no TCP reset, nothing answers) fails every call on a channel
with `channel_options()` within seconds, streams already open and unary calls started after the
freeze alike (issue 11, case 4: before, calls hung 62-69 s: gRPC's 60 s ping timeout).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from kvtransfer.grpc_options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, channel_options
from tests.pods.podproc import Pod, pod_channel, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
# The bound a frozen pod may cost, with room for a loaded machine; keepalive alone is ~8 s.
DETECTION_BOUND_SECONDS = 2 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5


@pytest.fixture
def frozen_prefill_pod():
    pod = Pod("prefill")
    try:
        pod.wait_ready()
        yield pod
    finally:
        pod.kill(signal.SIGCONT)
        pod.stop()


async def _fails_within(call, bound: float) -> float:
    """Seconds until `call` (awaitable) fails with UNAVAILABLE; asserts it does within `bound`."""
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await asyncio.wait_for(call, bound)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value
    return time.monotonic() - start


def test_frozen_pod_fails_open_streams_and_new_unary_calls_within_seconds(frozen_prefill_pod):
    pod = frozen_prefill_pod

    async def scenario():
        async with pod_channel(pod.address, options=channel_options()) as channel:
            stub = pb_grpc.PrefillServiceStub(channel)
            watch = stub.WatchLoad(pb.WatchLoadRequest(interval_seconds=0.05))
            await watch.read()                             # connected, streaming
            pod.kill(signal.SIGSTOP)
            await asyncio.sleep(0.2)

            async def drain_watch():
                while await watch.read() is not grpc.aio.EOF:
                    pass
            # A unary call started on the frozen pod, with a deadline far beyond the bound.
            prefill = stub.Prefill(pb.PrefillRequest(request_id="frozen", prompt_token_ids=[1, 5, 6, 7],
                                                     sampling=sampling(max_tokens=4)), timeout=600)
            stream_s, unary_s = await asyncio.gather(_fails_within(drain_watch(), DETECTION_BOUND_SECONDS),
                                                     _fails_within(prefill, DETECTION_BOUND_SECONDS))
            print(f"frozen pod detected: open stream after {stream_s:.1f}s, unary Prefill after {unary_s:.1f}s")

    run(scenario())
