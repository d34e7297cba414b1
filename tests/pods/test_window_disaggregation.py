"""Sliding-window models in P/D: 1 prefill + 1 decode pod as real processes give the colocated
engine's tokens (greedy and seeded, gRPC and Gloo transports) for prompts longer than the window.

The Mistral checkpoint windows every layer, so the decode pod frees the blocks behind the window
as it decodes (the prefill pod keeps a prompt's blocks for the pull); Gemma 3 mixes local and
global layers, so nothing is freed early. Both pods advertise the per-layer windows in the KV
layout handshake, and every block is free again at the end on both.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.hf_window_models import make_window_model
from tests.pods.podproc import AUTH, disaggregated, pod_pair, run, sampling
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

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decode, f"{name}-{transport}-{mode}-{i}", p, sampling(**PARAMS[mode]), transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    assert all(not messages[0].local_prefill for _, messages in results)   # the KV came from the prefill pod
    prefill.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)
    decode.wait_free_blocks(NUM_BLOCKS - 1, timeout=30)


def test_handshake_advertises_the_layer_windows(setup):
    name, prefill, decode, reference = setup
    import grpc

    with grpc.insecure_channel(decode.address) as channel:
        info = pb_grpc.DecodeServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10, metadata=AUTH).model
    assert tuple(info.layer_windows) == reference.model_config.layer_windows and any(info.layer_windows)
