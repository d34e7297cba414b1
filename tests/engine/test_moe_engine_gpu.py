"""On a GPU: an MoE model through the fused Triton kernel gives transformers' greedy tokens, and
its decode steps replayed from CUDA graphs give the eager steps' tokens. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.engine.hf_models import make_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe_packed", "qwen3_moe"])
def test_moe_on_cuda_equals_transformers_with_and_without_graphs(tmp_path, name):
    hf = make_hf_model(name, tmp_path)
    prompts = [[3 + (7 * i + j) % 290 for j in range(5 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    outputs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager,
                                     cache=CacheConfig(block_size=16, num_blocks=128),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)))
        assert (engine.runner.decode_buckets is None) == eager
        outputs[eager] = [list(o.output_token_ids) for o in engine.generate(prompts, [params] * len(prompts))]
    assert outputs[False] == outputs[True]
    with torch.no_grad():
        for prompt, ours in zip(prompts, outputs[True]):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
            assert ours == want
