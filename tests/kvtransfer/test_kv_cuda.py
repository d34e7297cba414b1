"""CUDA caches: staging through pinned host memory on both sides (skipped without CUDA)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from kvtransfer.layout import KVLayout
from kvtransfer.packing import Run, checksum, run_bytes, write_run
from kvtransfer.testing import PullKVServicer, start_server

from kv_helpers import make_kv, same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]
LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_run_bytes_and_write_run_on_cuda():
    src = make_kv(LAYOUT, num_blocks=8).cuda()
    dst = torch.zeros_like(src)
    staging = torch.empty(3 * LAYOUT.bytes_per_block, dtype=torch.uint8, pin_memory=True)
    data = bytes(run_bytes(src, Run(0, 3, 2), staging))
    write_run(dst, [7, 1, 4], data, checksum(data), dtype="bfloat16")
    for s, d in zip([2, 3, 4], [7, 1, 4]):
        assert same_bytes(src[s].cpu(), dst[d].cpu())


def test_pull_kv_between_cuda_caches():
    async def scenario():
        src = make_kv(LAYOUT, num_blocks=8).cuda()
        model = LAYOUT.to_model_info("tiny", "fp")
        servicer = PullKVServicer(src, model)
        servicer.add_request("g", num_prompt_tokens=70).finish(3, [1, 2, 3, 6, 7])
        server, port = await start_server(servicer)
        dst = torch.zeros_like(src)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                request = cbserve_pb2.PullKVRequest(request_id="g", model=model, transport="grpc")
                sink = KVSink(dst, [5, 4, 3, 2, 1], "g", 70)
                await pull_kv(cbserve_pb2_grpc.PrefillServiceStub(channel), request, sink, timeout=20)
        finally:
            await server.stop(0)
        for s, d in zip([1, 2, 3, 6, 7], [5, 4, 3, 2, 1]):
            assert same_bytes(src[s].cpu(), dst[d].cpu())

    asyncio.run(scenario())
