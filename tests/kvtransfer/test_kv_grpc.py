"""PullKV over a real grpc.aio server on 127.0.0.1: KVSource behind a test servicer, KVSink
in the client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.errors import ChecksumError, LayoutError, SourceAbortedError, SourceLostError
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from kvtransfer.testing import PullKVServicer, start_server

from kv_helpers import TINY, make_kv, same_bytes

pytestmark = pytest.mark.timeout(60)

MODEL = TINY.to_model_info("tiny", "fp-tiny")
SRC_IDS = [3, 4, 5, 9, 10, 11, 12, 2, 13, 14]  # 10 blocks: 37 tokens at block size 4
DST_IDS = [15, 1, 2, 3, 7, 8, 9, 10, 4, 5]


def pull_request(request_id: str, max_chunk_bytes: int = 0, model=MODEL) -> cbserve_pb2.PullKVRequest:
    return cbserve_pb2.PullKVRequest(request_id=request_id, model=model, transport="grpc",
                                     max_chunk_bytes=max_chunk_bytes)


class Recorder:
    """Wraps a PullKV call and remembers each chunk's shape as it arrives."""

    def __init__(self, call) -> None:
        self.call = call
        self.seen: list[tuple[int, int, bool]] = []

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        async for chunk in self.call:
            self.seen.append((chunk.first_block_index, chunk.num_blocks, chunk.last))
            yield chunk


async def with_server(body, chunk_filter=None):
    kv = make_kv(TINY, num_blocks=16)
    servicer = PullKVServicer(kv, MODEL, chunk_filter=chunk_filter)
    server, port = await start_server(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            await body(kv, servicer, cbserve_pb2_grpc.PrefillServiceStub(channel))
    finally:
        await server.stop(0)


def test_blocks_stream_as_they_become_full():
    async def body(src_kv, servicer, stub):
        progress = servicer.add_request("r1", num_prompt_tokens=37)
        dst_kv = torch.zeros_like(src_kv)
        sink = KVSink(dst_kv, DST_IDS, "r1", 37)
        recorder = Recorder(stub.PullKV(pull_request("r1", max_chunk_bytes=3 * TINY.bytes_per_block)))
        pull = asyncio.create_task(sink.consume(recorder))

        async def until(num_blocks: int) -> None:
            while sink.num_blocks_received < num_blocks:
                await asyncio.sleep(0.005)

        progress.advance(10, SRC_IDS[:3])      # 2 full blocks
        await asyncio.wait_for(until(2), 5)
        assert recorder.seen == [(0, 2, False)]
        progress.advance(33, SRC_IDS[:9])      # 8 full blocks; block 8 is partial: held back
        await asyncio.wait_for(until(8), 5)
        assert recorder.seen[1:] == [(2, 1, False), (3, 3, False), (6, 1, False), (7, 1, False)]
        assert not pull.done()
        logprobs = cbserve_pb2.TokenLogprobs(logprob=-0.5, top=[cbserve_pb2.TopLogprob(token_id=42, logprob=-0.5)])
        progress.finish(42, SRC_IDS, logprobs)
        result = await asyncio.wait_for(pull, 5)
        assert recorder.seen[5:] == [(8, 2, True)]
        assert (result.first_token_id, result.num_blocks) == (42, 10)
        assert result.first_token_logprobs == logprobs
        assert result.num_bytes == 10 * TINY.bytes_per_block
        for src_id, dst_id in zip(SRC_IDS, DST_IDS):
            assert same_bytes(src_kv[src_id], dst_kv[dst_id])
        await asyncio.wait_for(servicer.closed["r1"].wait(), 5)
        assert servicer.outcomes["r1"] == "finished"

    asyncio.run(with_server(body))


def test_pull_after_prefill_finished_gets_everything_at_once():
    async def body(src_kv, servicer, stub):
        servicer.add_request("held", num_prompt_tokens=40).finish(7, SRC_IDS)
        dst_kv = torch.zeros_like(src_kv)
        recorder = Recorder(stub.PullKV(pull_request("held")))
        result = await KVSink(dst_kv, DST_IDS, "held", 40).consume(recorder)
        assert recorder.seen == [(0, 3, False), (3, 4, False), (7, 1, False), (8, 2, True)]
        assert result.first_token_id == 7 and result.first_token_logprobs is None
        assert all(same_bytes(src_kv[s], dst_kv[d]) for s, d in zip(SRC_IDS, DST_IDS))

    asyncio.run(with_server(body))


def test_corrupted_chunk_is_refused_and_the_source_learns_at_once():
    def corrupt_second(chunk):
        if chunk.first_block_index == 3:
            data = bytearray(chunk.data)
            data[5] ^= 0x01
            chunk.data = bytes(data)
        return chunk

    async def body(src_kv, servicer, stub):
        # Prefill still running: the stream stays open, so only the client can end it.
        servicer.add_request("bad", num_prompt_tokens=40).advance(36, SRC_IDS[:9])
        sink = KVSink(torch.zeros_like(src_kv), DST_IDS, "bad", 40)
        with pytest.raises(ChecksumError, match="crc32 mismatch"):
            await pull_kv(stub, pull_request("bad"), sink, timeout=10)
        assert sink.num_blocks_received == 3  # the first run landed, the corrupt one did not
        await asyncio.wait_for(servicer.closed["bad"].wait(), 2)
        assert servicer.outcomes["bad"] == "cancelled"

    asyncio.run(with_server(body, chunk_filter=corrupt_second))


def test_client_cancel_mid_stream_releases_the_lease_promptly():
    async def body(src_kv, servicer, stub):
        progress = servicer.add_request("c", num_prompt_tokens=40)
        progress.advance(16, SRC_IDS[:4])
        sink = KVSink(torch.zeros_like(src_kv), DST_IDS, "c", 40)
        pull = asyncio.create_task(pull_kv(stub, pull_request("c"), sink, timeout=30))
        while sink.num_blocks_received < 4:
            await asyncio.sleep(0.005)
        started = time.monotonic()
        pull.cancel()  # e.g. the client disconnected from the router
        with pytest.raises(asyncio.CancelledError):
            await pull
        await asyncio.wait_for(servicer.closed["c"].wait(), 2)
        assert time.monotonic() - started < 1.0
        assert servicer.outcomes["c"] == "cancelled"

    asyncio.run(with_server(body))


def test_incompatible_model_and_unknown_request_are_typed():
    async def body(src_kv, servicer, stub):
        servicer.add_request("m", num_prompt_tokens=8).finish(1, [1, 2])
        other = cbserve_pb2.ModelInfo()
        other.CopyFrom(MODEL)
        other.head_dim = 16
        sink = KVSink(torch.zeros_like(src_kv), [3, 4], "m", 8)
        with pytest.raises(LayoutError, match="head_dim: 8 here vs 16 there"):
            await pull_kv(stub, pull_request("m", model=other), sink)
        with pytest.raises(SourceLostError) as lost:
            await pull_kv(stub, pull_request("nobody"), KVSink(torch.zeros_like(src_kv), [3, 4], "nobody", 8))
        assert lost.value.code == "NOT_FOUND"

    asyncio.run(with_server(body))


def test_prefill_pod_dying_mid_stream_gives_a_typed_error_fast():
    script = Path(__file__).with_name("kv_server_proc.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        port = int(server.stdout.readline())

        async def body():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                stub = cbserve_pb2_grpc.PrefillServiceStub(channel)
                sink = KVSink(torch.zeros((16, *TINY.block_shape)), list(range(1, 11)), "r", 40)
                pull = asyncio.create_task(pull_kv(stub, pull_request("r"), sink, timeout=30))
                while sink.num_blocks_received < 4:
                    await asyncio.sleep(0.005)
                killed = time.monotonic()
                os.kill(server.pid, signal.SIGKILL)
                with pytest.raises(SourceLostError) as lost:
                    await pull
                return time.monotonic() - killed, lost.value.code

        elapsed, code = asyncio.run(body())
        assert code == "UNAVAILABLE" and elapsed < 2.0
    finally:
        server.kill()
        server.wait()


def test_engine_giving_up_reaches_the_puller_as_aborted():
    async def body(src_kv, servicer, stub):
        progress = servicer.add_request("p", num_prompt_tokens=40)
        progress.advance(8, SRC_IDS[:2])
        sink = KVSink(torch.zeros_like(src_kv), DST_IDS, "p", 40)
        pull = asyncio.create_task(pull_kv(stub, pull_request("p"), sink, timeout=10))
        while sink.num_blocks_received < 2:
            await asyncio.sleep(0.005)
        progress.fail("preempted on the prefill pod")
        with pytest.raises(SourceAbortedError, match="ABORTED: .*preempted on the prefill pod"):
            await pull
        assert servicer.outcomes["p"].startswith("aborted")

    asyncio.run(with_server(body))
