"""SetupTransport + PullKV over pair groups, two independent pairs in one process (Gloo)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from wire import cbserve_pb2, cbserve_pb2_grpc
from kvtransfer.collective import host_store
from kvtransfer.grpc_options import channel_options
from kvtransfer.grpc_transport import KVSink, pull_kv
from kvtransfer.pair_setup import open_pair
from kvtransfer.testing import PairSetupServicer, start_server

from kv_helpers import TINY, make_kv, same_bytes

pytestmark = pytest.mark.timeout(60)
MODEL = TINY.to_model_info("tiny", "fp-tiny")


def test_two_pairs_set_up_over_grpc_move_kv_concurrently():
    async def scenario():
        src = make_kv(TINY, num_blocks=16, seed=3)
        servicer = PairSetupServicer(src, MODEL)
        server, port = await start_server(servicer)
        store = host_store("127.0.0.1", 0)  # one store for all of this "decode pod"'s pairs
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                stub = cbserve_pb2_grpc.PrefillServiceStub(channel)
                groups = await asyncio.gather(*(
                    open_pair(stub, store, advertise_host="127.0.0.1", group_name=name, timeout_s=10)
                    for name in ("d0->p", "d1->p")))
                assert set(servicer.groups) == {"d0->p", "d1->p"}
                src_ids = {"x": [1, 2, 3, 8, 9], "y": [10, 11, 4, 5, 6]}
                for request_id, ids in src_ids.items():
                    servicer.add_request(request_id, num_prompt_tokens=18).finish(5, ids)
                dst = torch.zeros_like(src)
                dst_ids = {"x": [15, 14, 13, 12, 11], "y": [1, 2, 3, 4, 5]}

                async def pull(request_id, group):
                    request = cbserve_pb2.PullKVRequest(
                        request_id=request_id, model=MODEL, transport="nccl",
                        nccl_group=group.group_name, max_chunk_bytes=TINY.bytes_per_block)
                    sink = KVSink(dst, dst_ids[request_id], request_id, 18, group=group)
                    return await pull_kv(stub, request, sink, timeout=10)

                results = await asyncio.gather(pull("x", groups[0]), pull("y", groups[1]))
                assert [r.num_blocks for r in results] == [5, 5]
                for request_id in src_ids:
                    for s, d in zip(src_ids[request_id], dst_ids[request_id]):
                        assert same_bytes(src[s], dst[d])
                # A retried pull of the same request on the same pair still gets its runs.
                dst.zero_()
                servicer.add_request("x", num_prompt_tokens=18).finish(5, src_ids["x"])
                assert (await pull("x", groups[0])).num_blocks == 5
                assert all(same_bytes(src[s], dst[d]) for s, d in zip(src_ids["x"], dst_ids["x"]))
                for group in servicer.groups.values():
                    group.close()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_setup_refuses_a_bad_backend():
    async def scenario():
        servicer = PairSetupServicer(make_kv(), MODEL)
        server, port = await start_server(servicer)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cbserve_pb2_grpc.PrefillServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.SetupTransport(cbserve_pb2.SetupTransportRequest(
                        group="g", store_host="127.0.0.1", store_port=1, backend="mpi"))
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(0)

    asyncio.run(scenario())
