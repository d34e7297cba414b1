"""On two or more GPUs: TP=2 over NCCL decodes the greedy tokens of TP=1 (fp32, tiny preset).
Skipped without CUDA or with fewer than 2 devices (NCCL will not put two ranks on one GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def _tokens(tp: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", tensor_parallel_size=tp,
                                 cache=CacheConfig(num_blocks=256)))
    try:
        prompts = [[1, *range(10, 10 + n)] for n in (4, 70, 200)]
        return [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))]
    finally:
        engine.close()


def test_tp2_on_nccl_equals_tp1():
    assert _tokens(2) == _tokens(1)
