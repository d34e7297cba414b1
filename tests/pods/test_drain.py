"""SIGTERM drains a pod: unready at once, in-flight streams and pending KV pulls finish, then exit."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from tests.pods.podproc import Pod, pod_channel, run, sampling, vouched

pytestmark = pytest.mark.slow
DRAIN = 20.0


async def _health(address: str) -> int:
    async with pod_channel(address) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)).status


def test_sigterm_lets_a_decode_stream_finish_then_exits():
    decode = Pod("decode", "--drain-seconds", str(DRAIN)).wait_ready()
    try:
        async def scenario():
            async with pod_channel(decode.address) as ch:
                stub = pb_grpc.DecodeServiceStub(ch)
                gen = stub.Generate(pb.GenerateRequest(request_id="long", prompt_token_ids=[1, 9, 9, 9],
                                                       sampling=sampling(max_tokens=300, ignore_eos=True)),
                                    timeout=60)
                first = await gen.read()
                decode.kill(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.3)
                assert await _health(decode.address) == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:   # no new work while draining
                    await stub.Generate(pb.GenerateRequest(request_id="new", prompt_token_ids=[1, 5],
                                                           sampling=sampling(max_tokens=2)), timeout=5).read()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                messages = [first]
                while (m := await gen.read()) != grpc.aio.EOF:
                    messages.append(m)
                return messages, sent

        messages, sent = run(scenario())
        assert sum(len(m.token_ids) for m in messages) == 300 and messages[-1].finished
        decode.proc.wait(DRAIN)
        assert time.monotonic() - sent < DRAIN
        assert decode.proc.returncode == 0
    finally:
        decode.stop()


def test_sigterm_waits_for_a_pending_kv_pull():
    prefill = Pod("prefill", "--drain-seconds", str(DRAIN)).wait_ready()
    decode = Pod("decode").wait_ready()
    try:
        async def scenario():
            async with pod_channel(prefill.address) as pc, \
                    pod_channel(decode.address) as dc:
                prompt = [1] + list(range(10, 90))
                params = sampling(max_tokens=5, temperature=0.0)
                await pb_grpc.PrefillServiceStub(pc).Prefill(pb.PrefillRequest(
                    request_id="held", prompt_token_ids=prompt, sampling=params), timeout=30)
                prefill.kill(signal.SIGTERM)          # the KV is held, not yet pulled
                await asyncio.sleep(0.5)
                assert prefill.proc.poll() is None    # it waits for the pull
                gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                    request_id="held", prompt_token_ids=prompt, sampling=params,
                    prefill_from=prefill.address)), timeout=30)
                return [m async for m in gen]

        messages = run(scenario())
        assert not messages[0].local_prefill       # pulled from the draining prefill pod
        assert sum(len(m.token_ids) for m in messages) == 5
        prefill.proc.wait(5)
        assert prefill.proc.returncode == 0
    finally:
        prefill.stop()
        decode.stop()
