"""1 prefill + 1 decode pod as real processes serving a mixture of experts (Qwen2-MoE: a shared
expert, a dense layer among MoE ones, top-3 of 5): disaggregated tokens equal the colocated
engine's, greedy and seeded, over both transports, with chunked prefill and a shared prefix."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_hf_model
from tests.pods.podproc import Pod, disaggregated, run, sampling

pytestmark = pytest.mark.slow

PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=12),
    "seeded": dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=12),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-moe")
    make_hf_model("qwen2_moe_packed", path)
    return path


@pytest.fixture(scope="module")
def pods(checkpoint):
    prefill = Pod("prefill", "--model", str(checkpoint), "--kv-transport", "nccl")
    decode = Pod("decode", "--model", str(checkpoint), "--kv-transport", "nccl")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [1] + [rng.randrange(4, 290) for _ in range(70)]
    return [
        [1] + [rng.randrange(4, 290) for _ in range(130)],    # longer than the 64-token step budget
        [1] + [rng.randrange(4, 290) for _ in range(21)],
        shared + [rng.randrange(4, 290) for _ in range(19)],  # shared prefix ...
        shared + [rng.randrange(4, 290) for _ in range(5)],   # ... with this one
        [1, 5],
    ]


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_moe_disaggregated_equals_colocated(checkpoint, pods, transport, mode):
    prefill, decode = pods
    reference = Engine(EngineConfig(model=str(checkpoint), cache=CacheConfig(num_blocks=512),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    prompts = _prompts()
    expected = [o.output_token_ids for o in reference.generate(prompts, SamplingParams(**PARAMS[mode]))]

    async def all_at_once():
        return await asyncio.gather(*(
            disaggregated(prefill, decode, f"moe-{transport}-{mode}-{i}", p, sampling(**PARAMS[mode]), transport)
            for i, p in enumerate(prompts)))

    results = run(all_at_once())
    assert [tokens for tokens, _ in results] == expected
    for _, messages in results:
        assert not messages[0].local_prefill           # the KV really came from the prefill pod
        assert messages[-1].finished and messages[-1].finish_reason == "length"
