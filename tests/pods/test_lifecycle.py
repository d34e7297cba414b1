"""Lifetimes across real pod processes: aborts at every stage, cancellations, dead peers, bad KV.

After each scenario every pod's free-block count must be back where it started: no stage may
strand KV (the anchors hold it for minutes). The open PullKV stream is the lease.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
import torch

from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from kvtransfer.grpc_transport import KVSource
from kvtransfer.progress import KVProgress
from tests.pods.podproc import Pod, disaggregated, pod_channel, run, sampling, vouched

pytestmark = pytest.mark.slow
LONG = 1500  # prompt tokens
# A small budget makes the long prompt ~94 prefill steps, so "mid-prefill" is wide enough to hit.
SLOW = ("--max-num-batched-tokens", "16")


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(4, 260) for _ in range(n - 1)]


@pytest.fixture(scope="module")
def pods():
    prefill, decode = Pod("prefill", "--kv-ttl-seconds", "2", *SLOW), Pod("decode", *SLOW)
    try:
        prefill.wait_ready(), decode.wait_ready()
        yield prefill, decode, prefill.load().num_free_blocks, decode.load().num_free_blocks
    finally:
        prefill.stop()
        decode.stop()


def assert_all_free(pods, timeout: float = 3.0) -> None:
    prefill, decode, p_free, d_free = pods
    prefill.wait_free_blocks(p_free, timeout)
    decode.wait_free_blocks(d_free, timeout)


def stubs(prefill, decode):
    pc, dc = pod_channel(prefill.address), pod_channel(decode.address)
    return pc, dc, pb_grpc.PrefillServiceStub(pc), pb_grpc.DecodeServiceStub(dc)


async def _cancel_after(call, seconds: float):
    await asyncio.sleep(seconds)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


def test_abort_before_prefill(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        busy = ps.Prefill(pb.PrefillRequest(request_id="busy", prompt_token_ids=prompt(LONG),
                                            sampling=sampling(max_tokens=4)), timeout=30)
        await asyncio.sleep(0.05)
        queued = ps.Prefill(pb.PrefillRequest(request_id="queued", prompt_token_ids=prompt(100, 1),
                                              sampling=sampling(max_tokens=4)), timeout=30)
        await asyncio.sleep(0.05)  # queued behind `busy`, nothing computed
        found = await ps.Abort(pb.AbortRequest(request_id="queued"))
        assert found.found
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await queued
        assert err.value.code() == grpc.StatusCode.ABORTED
        await busy
        assert (await ps.Abort(pb.AbortRequest(request_id="busy"))).found  # held -> released
        assert not (await ps.Abort(pb.AbortRequest(request_id="busy"))).found  # idempotent
        await pc.close(), await dc.close()

    run(scenario())
    assert_all_free(pods)


def test_abort_during_prefill_by_cancellation(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        call = ps.Prefill(pb.PrefillRequest(request_id="mid", prompt_token_ids=prompt(LONG, 2),
                                            sampling=sampling(max_tokens=4)), timeout=30)
        await _cancel_after(call, 0.2)
        await pc.close(), await dc.close()

    run(scenario())
    assert_all_free(pods)


def test_held_kv_is_released_by_abort_and_by_ttl(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        for rid in ("held-abort", "held-ttl"):
            await ps.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt(80, 3),
                                               sampling=sampling(max_tokens=4)), timeout=30)
        assert (await ps.GetLoad(pb.LoadRequest())).num_held_kv == 2
        assert (await ps.Abort(pb.AbortRequest(request_id="held-abort"))).found
        await pc.close(), await dc.close()

    run(scenario())
    start = time.monotonic()
    assert_all_free(pods, timeout=5.0)     # the TTL is 2 s here
    assert time.monotonic() - start > 0.5  # ... so the second one was released by the TTL, not at once


def test_cancel_during_pull_frees_both_pods(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        p = prompt(LONG, 4)
        pre = ps.Prefill(pb.PrefillRequest(request_id="pull", prompt_token_ids=p, sampling=sampling(max_tokens=4)),
                         timeout=30)
        gen = ds.Generate(vouched(pb.GenerateRequest(
            request_id="pull", prompt_token_ids=p, sampling=sampling(max_tokens=4),
            prefill_from=prefill.address)), timeout=30)
        await asyncio.sleep(0.3)    # the pull streams while P is still prefilling
        gen.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:   # P aborted the request: the lease broke
            await pre
        assert err.value.code() == grpc.StatusCode.ABORTED
        await pc.close(), await dc.close()

    run(scenario())
    assert_all_free(pods, timeout=1.0)


def test_client_cancels_mid_stream_during_decode(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        p = prompt(60, 5)
        pre = ps.Prefill(pb.PrefillRequest(request_id="dec", prompt_token_ids=p, sampling=sampling(max_tokens=500)),
                         timeout=30)
        gen = ds.Generate(vouched(pb.GenerateRequest(
            request_id="dec", prompt_token_ids=p, sampling=sampling(max_tokens=500),
            prefill_from=prefill.address)), timeout=30)
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 5:
                gen.cancel()
                break
        await pre
        await pc.close(), await dc.close()

    run(scenario())
    assert_all_free(pods)


def test_abort_rpc_ends_a_generate_stream(pods):
    prefill, decode, *_ = pods

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        gen = ds.Generate(pb.GenerateRequest(request_id="ab", prompt_token_ids=prompt(30, 6),
                                             sampling=sampling(max_tokens=500)), timeout=30)
        await gen.read()
        assert (await ds.Abort(pb.AbortRequest(request_id="ab"))).found
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await gen.read() != grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED
        await pc.close(), await dc.close()

    run(scenario())
    assert_all_free(pods)


# ---------------------------------------------------------------------- dead peers

@pytest.fixture
def fresh_pair():
    prefill, decode = Pod("prefill", *SLOW), Pod("decode", *SLOW)
    try:
        prefill.wait_ready(), decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_sigkill_prefill_during_transfer_falls_back_to_local_prefill(fresh_pair):
    prefill, decode = fresh_pair
    p = prompt(LONG, 7)
    params = dict(temperature=0.7, seed=77, max_tokens=8)
    reference = Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=256),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    expected = reference.generate([p], SamplingParams(**params))[0].output_token_ids
    d_free = decode.load().num_free_blocks

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        pre = ps.Prefill(pb.PrefillRequest(request_id="k", prompt_token_ids=p, sampling=sampling(**params)),
                         timeout=60)
        gen = ds.Generate(vouched(pb.GenerateRequest(request_id="k", prompt_token_ids=p, sampling=sampling(**params),
                                             prefill_from=prefill.address)), timeout=60)
        await asyncio.sleep(0.3)
        prefill.kill()
        messages = [m async for m in gen]
        pre.cancel()
        await pc.close(), await dc.close()
        return messages

    messages = run(scenario())
    assert messages[0].local_prefill
    assert [t for m in messages for t in m.token_ids] == expected
    decode.wait_free_blocks(d_free, 3.0)


def test_sigkill_decode_frees_prefill_blocks_within_a_second(fresh_pair):
    prefill, decode = fresh_pair
    p_free = prefill.load().num_free_blocks
    p = prompt(LONG, 8)

    async def scenario():
        pc, dc, ps, ds = stubs(prefill, decode)
        pre = ps.Prefill(pb.PrefillRequest(request_id="kd", prompt_token_ids=p, sampling=sampling(max_tokens=4)),
                         timeout=60)
        gen = ds.Generate(vouched(pb.GenerateRequest(
            request_id="kd", prompt_token_ids=p, sampling=sampling(max_tokens=4),
            prefill_from=prefill.address)), timeout=60)
        await asyncio.sleep(0.3)
        assert prefill.load().num_free_blocks < p_free      # the transfer is under way
        decode.kill()
        killed = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError):
            await pre
        gen.cancel()
        await pc.close(), await dc.close()
        return killed

    killed = run(scenario())
    prefill.wait_free_blocks(p_free, timeout=max(0.1, 1.0 - (time.monotonic() - killed)))


# ---------------------------------------------------------------------- refused KV

class CorruptingPrefill(pb_grpc.PrefillServiceServicer):
    """A prefill pod whose KV chunks are damaged in flight (a real gRPC server)."""

    def __init__(self, model: pb.ModelInfo) -> None:
        self.kv = torch.randn(32, model.num_layers, 2, model.block_size, model.num_kv_heads, model.head_dim)

    async def PullKV(self, request, context):
        n = 40
        progress = KVProgress(n)
        progress.finish(7, list(range(1, 4)))
        async for chunk in KVSource(self.kv, request.request_id, n).chunks(progress.events()):
            if chunk.data:
                data = bytearray(chunk.data)
                data[len(data) // 2] ^= 0xFF
                chunk.data = bytes(data)
            yield chunk


def test_corrupted_chunk_is_refused(pods):
    prefill, decode, *_ = pods

    async def scenario():
        async with pod_channel(decode.address) as dc:
            ds = pb_grpc.DecodeServiceStub(dc)
            model = (await ds.Handshake(pb.HandshakeRequest())).model
            server = grpc.aio.server()
            pb_grpc.add_PrefillServiceServicer_to_server(CorruptingPrefill(model), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                gen = ds.Generate(vouched(pb.GenerateRequest(request_id="bad", prompt_token_ids=prompt(40, 9),
                                                     sampling=sampling(max_tokens=4),
                                                     prefill_from=f"127.0.0.1:{port}")), timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in gen:
                        pytest.fail("a token was produced from corrupt KV")
                return err.value
            finally:
                await server.stop(0)

    error = run(scenario())
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "checksum" in error.details().lower() or "corrupt" in error.details().lower()
    assert_all_free(pods)


@pytest.mark.parametrize("mismatch", [("--block-size", "32"), ("--model", "HF"), ("--quantization", "int8")])
def test_mismatched_prefill_pod_is_refused(pods, mismatch, tmp_path):
    _, decode, *_ = pods
    flag, value = mismatch
    if value == "HF":
        from tests.engine.hf_models import make_hf_model

        make_hf_model("llama_gqa", tmp_path)
        value = str(tmp_path)
    other = Pod("prefill", flag, value).wait_ready()
    try:
        async def scenario():
            async with pod_channel(decode.address) as dc, \
                    pod_channel(other.address) as oc:
                ours = (await pb_grpc.DecodeServiceStub(dc).Handshake(pb.HandshakeRequest())).model
                with pytest.raises(grpc.aio.AioRpcError) as hs:
                    await pb_grpc.PrefillServiceStub(oc).Handshake(pb.HandshakeRequest(model=ours))
                assert hs.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                p = prompt(40, 10)
                pre = pb_grpc.PrefillServiceStub(oc).Prefill(pb.PrefillRequest(
                    request_id="mm", prompt_token_ids=p, sampling=sampling(max_tokens=4)), timeout=30)
                gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                    request_id="mm", prompt_token_ids=p, sampling=sampling(max_tokens=4),
                    prefill_from=other.address)), timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in gen:
                        pytest.fail("a token was produced from another model's KV")
                await pre
                return err.value

        error = run(scenario())
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        expected = "block_size" if flag == "--block-size" else "fingerprint"  # int8 K/V differ too
        assert expected in error.details()
    finally:
        other.stop()
    assert_all_free(pods)
