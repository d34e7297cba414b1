"""Issue 11 case 8: a prefill pod logged "KV not pulled within 30s" for requests whose KV had been
pulled, and its held-KV gauge stayed up for the TTL.

The race: the engine thread published the first token (`KVProgress.finish`) and only then checked
"is a pull open?" before holding the blocks under the TTL. The event loop could finish the whole
pull in between (ship the last chunk, close the stream, release the blocks), so the engine then
held blocks that were already released. Both sides live in the prefill pod's engine-core process
(`prefill_pod.core`). The test runs a real prefill pod in this process — its engine core on one
end of a socketpair, its gRPC server (`prefill_pod.server` over `pod.core_client`) on the other —
and forces that interleaving: `finish` waits, in the engine thread, until the pull has ended.
Before the fix the request is held afterwards and expires; now it is not.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import EngineConfig
from kvtransfer import progress as progress_mod
from kvtransfer.grpc_transport import KVSink, pull_kv
from pod.core_client import CoreRuntime, EngineCoreClient
from pod.runtime import PodConfig, PodRuntime
from prefill_pod.core import PrefillCore
from prefill_pod.server import SERVICE_NAME, PrefillServicer
from tests.pods.podproc import sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

TTL_SECONDS = 1.0
CONFIG = EngineConfig(model="tiny", role="prefill", cache=CacheConfig(num_blocks=64),
                      scheduler=SchedulerConfig(max_num_batched_tokens=64))
POD = PodConfig(port=0, kv_ttl_seconds=TTL_SECONDS)


@pytest.fixture(scope="module")
def core_runtime() -> PodRuntime:
    return PodRuntime(CONFIG, POD, "prefill")


def test_a_pull_that_ends_before_the_hold_leaves_nothing_held(core_runtime, monkeypatch):
    finish = progress_mod.KVProgress.finish
    core: PrefillCore | None = None
    waited: list[bool] = []

    def finish_then_let_the_pull_end(self, *args, **kwargs):
        finish(self, *args, **kwargs)
        # Engine thread: give the event loop all the time it needs to complete the pull now.
        deadline = time.monotonic() + 20.0
        while core.pulling and time.monotonic() < deadline:
            time.sleep(0.005)
        waited.append(not core.pulling)

    monkeypatch.setattr(progress_mod.KVProgress, "finish", finish_then_let_the_pull_end)
    prompt = [1] + [(7 * i) % 250 + 4 for i in range(150)]   # three prefill steps of 64 tokens

    async def scenario():
        nonlocal core
        ours, theirs = socket.socketpair()
        core = PrefillCore(core_runtime, theirs)
        core_done = asyncio.ensure_future(core.run())
        rt = CoreRuntime(CONFIG, POD, "prefill", argv=[])
        rt.loop = EngineCoreClient(rt, SERVICE_NAME)
        await rt.loop.connect(ours)
        server = grpc.aio.server()
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(rt), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.PrefillServiceStub(channel)
                # The pull opens first and waits for its Prefill, as a decode pod's may.
                sink_kv = torch.zeros_like(core_runtime.engine.kv_cache)
                blocks = list(range(1, 1 + -(-len(prompt) // core_runtime.layout.block_size)))
                sink = KVSink(sink_kv, blocks, "race-0", len(prompt))
                pull = asyncio.ensure_future(pull_kv(
                    stub, pb.PullKVRequest(request_id="race-0", model=rt.model_info), sink, timeout=30))
                while "race-0" not in core.pulling:
                    await asyncio.sleep(0.01)
                first = await stub.Prefill(pb.PrefillRequest(
                    request_id="race-0", prompt_token_ids=prompt, sampling=sampling(max_tokens=4)), timeout=30)
                result = await pull
                assert result.first_token_id == first.first_token_id
                await asyncio.sleep(TTL_SECONDS + 1.0)   # past the TTL: a stale hold would expire
                return core.held.num_held, core.held.num_expired, rt
        finally:
            await server.stop(None)
            rt.loop.stop()
            await asyncio.wait_for(core_done, 10)

    num_held, num_expired, rt = asyncio.run(scenario())
    assert waited == [True], "the pull did not end while the engine thread waited"
    assert (num_held, num_expired) == (0, 0)
    assert not rt.metrics.registry.get_sample_value("cbserve_kv_lease_expired_total", {"role": "prefill"})
    assert core_runtime.engine.scheduler.held == {}
