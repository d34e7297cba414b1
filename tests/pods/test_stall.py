"""A pod whose engine thread is stuck reports not ready, and the router's load tracking takes it out
of routing until it recovers (issue 11, case 4: `/ready` stayed 200 under a frozen pod).

The engine thread is stalled through its test fault hook (`engine.loop.FAULT_STALL_FILE_ENV`: it
hangs before each step while a file exists); the process's gRPC server keeps answering, so only
the pod itself can tell. Real pod process on loopback, real router `LoadTracker` in this process.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.loop import FAULT_STALL_FILE_ENV
from router.discovery.base import PodEndpoint
from router.load import LoadTracker
from pod.security import ClusterSecurity
from tests.pods.podproc import SECRET, Pod, pod_channel, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def stallable_pod(tmp_path):
    stall_file = tmp_path / "stall"
    pod = Pod("decode", "--colocated", "--stall-seconds", "2", env={FAULT_STALL_FILE_ENV: str(stall_file)})
    try:
        pod.wait_ready()
        yield pod, stall_file
    finally:
        pod.kill(signal.SIGCONT)
        pod.stop()


async def _until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < timeout, f"not {what} after {timeout}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


def test_stalled_engine_is_not_ready_fails_its_requests_and_is_out_of_routing_until_it_recovers(stallable_pod):
    pod, stall_file = stallable_pod

    async def scenario():
        tracker = LoadTracker(probe_interval_seconds=0.2, security=ClusterSecurity(secret=SECRET))
        tracker.set_endpoints(frozenset({PodEndpoint(pod.address, "colocated")}))
        state = tracker.pods[pod.address]
        async with pod_channel(pod.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status() -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

            async def routable() -> bool:
                return state.routable

            async def not_routable() -> bool:
                return not state.routable

            await _until(routable, 30, "routable")
            # Idle is not stalled: nothing runs, the engine thread waits for work.
            await asyncio.sleep(3)
            assert await status() == SERVING and state.routable

            stall_file.touch()
            call = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
                request_id="stalled", prompt_token_ids=[1, 5, 6, 7], sampling=sampling(max_tokens=4, temperature=0.0)),
                timeout=120)
            took = await _until(lambda: _is(status, NOT_SERVING), 30, "NOT_SERVING")
            print(f"stalled engine reported NOT_SERVING after {took:.1f}s (--stall-seconds 2)")
            await _until(not_routable, 10, "out of routing")

            # The request it held fails over at once (the router would run it elsewhere).
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call.read(), 10)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "stalled" in failed.value.details()

            stall_file.unlink()
            await _until(lambda: _is(status, SERVING), 30, "SERVING again")
            await _until(routable, 10, "back in routing")
            again = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
                request_id="after", prompt_token_ids=[1, 5, 6, 7], sampling=sampling(max_tokens=4, temperature=0.0)),
                timeout=60)
            assert len([t async for message in again for t in message.token_ids]) == 4
        await tracker.close()

    run(scenario())


async def _is(status, expected: int) -> bool:
    return await status() == expected


def test_threshold_grows_with_slow_steps_never_below_the_flag():
    from pod.stall import stall_threshold

    assert stall_threshold(10.0, []) == 10.0
    assert stall_threshold(10.0, [0.01, 0.2]) == 10.0
    assert stall_threshold(10.0, [0.5, 3.0]) == 30.0      # 3 s steps are this model's normal
