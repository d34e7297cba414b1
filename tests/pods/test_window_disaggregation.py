"""Sliding-window models in P/D: 1 prefill + 1 decode pod as real processes give the colocated
engine's tokens (greedy and seeded, gRPC and Gloo transports) for prompts longer than the window.

The Mistral checkpoint windows every layer, so the prefill pod frees the blocks behind the window
as its chunked prefill goes on, a pull moves only the blocks the decode pod's first query reads
(bytes counted on both pods), the decode pod reserves only those, and frees more as it decodes;
Gemma 3 mixes local and global layers, so every block is sent and nothing is freed early. Both
pods advertise the per-layer windows in the KV layout handshake, and every block is free again at
the end on both, also after a decode pod cancels mid-transfer.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from kvtransfer.layout import KVLayout
from tests.engine.hf_window_models import make_window_model
from tests.pods.podproc import AUTH, disaggregated, pod_channel, pod_pair, run, sampling, vouched
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NUM_BLOCKS = 128
ARGS = ("--block-size", "4", "--num-blocks", str(NUM_BLOCKS))


@pytest.fixture(scope="module", params=["mistral_window", "gemma3"])
def setup(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_window_model(request.param, path)
    reference = Engine(EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    with pod_pair("--model", str(path), "--kv-transport", "nccl", *ARGS) as (prefill, decode):
        yield request.param, prefill, decode, reference


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    return [
        [rng.randrange(3, 300) for _ in range(90)],        # longer than the 64-token budget, > 10 windows
        [rng.randrange(3, 300) for _ in range(23)],        # not a multiple of the block size
        shared + [rng.randrange(3, 300) for _ in range(9)],   # a shared prefix ...
        shared + [rng.randrange(3, 300) for _ in range(17)],  # ... with this one
        [5, 6],
    ]


def _sent_blocks(reference: Engine, num_prompt_tokens: int) -> int:
    """The blocks a pull moves: every layer windowed (Mistral), those from the one holding the
    first decode query's window edge on; else (Gemma 3) the whole prompt."""
    window, bs = reference.model_config.kv_free_window, 4
    first = max(0, num_prompt_tokens - window + 1) // bs if window else 0
    return -(-num_prompt_tokens // bs) - first


def _kv_bytes(pod) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    prefix = f'cbserve_kv_transfer_bytes_total{{role="{pod.role}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def _block_bytes(pod) -> int:
    with grpc.insecure_channel(pod.address) as channel:
        info = pb_grpc.DecodeServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10, metadata=AUTH).model
    return KVLayout.from_model_info(info).bytes_per_block


PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=24),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=99, max_tokens=24),
}


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_disaggregated_equals_colocated_with_windows(setup, transport, mode):
    name, prefill, decode, reference = setup
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]
    bytes_before = _kv_bytes(prefill), _kv_bytes(decode)

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decode, f"{name}-{transport}-{mode}-{i}", p, sampling(**PARAMS[mode]), transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    assert all(not messages[0].local_prefill for _, messages in results)   # the KV came from the prefill pod
    prefill.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)
    decode.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)
    # Mistral (window 9, blocks of 4): the 90-token prompt moves 3 blocks, not 23; Gemma 3 every block.
    sent = sum(_sent_blocks(reference, len(p)) for p in prompts)
    assert sent == (13 if name == "mistral_window" else 58)
    sent_bytes = sent * _block_bytes(decode)
    assert (_kv_bytes(prefill) - bytes_before[0], _kv_bytes(decode) - bytes_before[1]) == (sent_bytes, sent_bytes)


def test_cancel_mid_transfer_frees_both_pods_and_each_holds_the_window(setup):
    """The decode pod reserves a 500-token prompt's blocks (Mistral: 2 of 125) before the prefill
    pod has it; the prefill pod then runs it in 64-token chunks holding at most the window and a
    chunk (Mistral: 19 blocks, not 125), and the decode pod cancels while the KV is on its way:
    no block stays taken on either pod."""
    name, prefill, decode, reference = setup
    prompt = [random.Random(5).randrange(3, 300) for _ in range(500)]
    held_bound = 19 if name == "mistral_window" else 125

    async def scenario():
        async with pod_channel(prefill.address) as pc, pod_channel(decode.address) as dc:
            gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(pb.GenerateRequest(
                request_id=f"{name}-cancel", prompt_token_ids=prompt, sampling=sampling(max_tokens=8),
                prefill_from=prefill.address, kv_transport="nccl")), timeout=30)
            reading = asyncio.ensure_future(gen.read())
            reserved = NUM_BLOCKS - 1 - _sent_blocks(reference, len(prompt))
            await asyncio.to_thread(decode.wait_free_blocks, reserved, 30)   # the pull waits for its prefill
            pre = pb_grpc.PrefillServiceStub(pc).Prefill(pb.PrefillRequest(
                request_id=f"{name}-cancel", prompt_token_ids=prompt, sampling=sampling(max_tokens=8)), timeout=30)
            for _ in range(4):      # while it prefills (or its KV is held for the pull)
                report = await asyncio.to_thread(prefill.load)
                assert NUM_BLOCKS - 1 - report.num_free_blocks <= held_bound
            gen.cancel()
            await asyncio.gather(reading, pre, return_exceptions=True)

    run(scenario())
    prefill.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)
    decode.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)
