"""Aborts during KV transfer into a tiny decode pool, which forces every block to be reused many
times, then greedy outputs bit-identical to a clean run.

A pull cancelled mid-transfer must leave nothing behind in the blocks it was writing: a late
write into a block freed and handed to the next request would corrupt that request's KV (a
different greedy continuation), and a leaked block would shrink the pool for good.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.faults.cluster import start_pods, wait_idle
from tests.pods.podproc import pod_channel, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

DECODE_BLOCKS = 24          # 16-token blocks: three of these prompts (plus their decode) at once
NUM_ABORTED = 60
PROMPTS = [[1] + [(17 * k + 5 * i) % 250 + 4 for k in range(100)] for i in range(4)]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_pool():
    # P prefills 16 tokens a step, so each prompt's KV streams in several chunks to abort between.
    prefill, decode = start_pods(("prefill", "--max-num-batched-tokens", "16"),
                                 ("decode", "--num-blocks", str(DECODE_BLOCKS)))
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


async def _run(p_stub, d_stub, address: str, rid: str, prompt: list[int], cancel_after: float | None):
    params = sampling(**GREEDY)
    pre = p_stub.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=params), timeout=120)
    gen = d_stub.Generate(vouched(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=params,
                                             prefill_from=address)), timeout=120)
    if cancel_after is not None:
        await asyncio.sleep(cancel_after)
        gen.cancel()
        pre.cancel()
        await asyncio.gather(gen.code(), pre.code(), return_exceptions=True)
        return None
    messages = [m async for m in gen]
    await pre
    return [t for m in messages for t in m.token_ids], messages[0].local_prefill


def _round(prefill, decode, tag: str, aborted: int = 0) -> list:
    rng = random.Random(7)

    async def go():
        async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
            p_stub, d_stub = pb_grpc.PrefillServiceStub(pc), pb_grpc.DecodeServiceStub(dc)
            gate = asyncio.Semaphore(6)   # more than the pool holds: some wait for blocks

            async def one(i: int, prompt, cancel_after):
                async with gate:
                    return await _run(p_stub, d_stub, prefill.address, f"{tag}-{i}", prompt, cancel_after)

            work = [one(i, rng.choice(PROMPTS), rng.uniform(0.0, 0.4)) for i in range(aborted)]
            work += [one(aborted + i, p, None) for i, p in enumerate(PROMPTS)]
            return (await asyncio.gather(*work))[aborted:]
    return asyncio.run(go())


def test_aborts_during_transfer_into_a_tiny_pool_then_bit_identical_outputs(tiny_pool):
    prefill, decode = tiny_pool
    clean = _round(prefill, decode, "clean")
    assert not any(local for _, local in clean)
    wait_idle([prefill, decode])

    after = _round(prefill, decode, "storm", aborted=NUM_ABORTED)   # the clean prompts run last
    assert [tokens for tokens, _ in after] == [tokens for tokens, _ in clean]
    wait_idle([prefill, decode])
    again = _round(prefill, decode, "after")
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in clean]
    assert not any(local for _, local in again)
    wait_idle([prefill, decode])
