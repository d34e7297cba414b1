"""Sliding-window families against transformers: Mistral with a window shorter than the prompts,
Gemma 3 (interleaved local/global layers, local RoPE base, query scale, four norms, softcap) and
gpt-oss (sinks, alternating sliding/full layers, YaRN, biased MoE with the clamped SwiGLU).

Greedy tokens and the logits at every sampled position equal transformers' through chunked
prefill, mid-flight arrivals, preemption by recompute and prefix-cache hits; a model whose every
layer is windowed frees the blocks behind the window (a long request holds a bounded number of
blocks), and no family leaks a block.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.hf_window_models import WINDOW_CONFIGS, make_window_model
from tests.engine.test_hf_equivalence import check_against_transformers


@pytest.fixture(scope="module", params=sorted(WINDOW_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_window_model(request.param, path)


def _engine(path, num_blocks: int = 40, **cache) -> Engine:
    return Engine(EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_blocks=num_blocks, **cache),
                               scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)))


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n))
    return list(out[0].output_token_ids)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    name, path, hf = checkpoint
    windows = WINDOW_CONFIGS[name][2]["sliding_window"]
    # 39 usable blocks of 4 tokens: with windows freed the six requests still preempt each other
    # now and then; the prompts (5..64 tokens) and 16-token chunks cross every window edge.
    engine = _engine(path, num_blocks=40)
    assert engine.model_config.layer_windows and min(w for w in engine.model_config.layer_windows if w) == windows
    check_against_transformers(name, engine, hf)
    engine.scheduler.check_invariants()


def test_greedy_tokens_are_not_degenerate(checkpoint):
    # The checkpoints are drawn so that greedy decoding moves: equal tokens must mean something.
    name, path, hf = checkpoint
    rng = random.Random(7)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(30)]
    assert len(set(_hf_greedy(hf, prompt, 24))) >= 4


def test_a_windowed_model_frees_the_blocks_behind_its_window(checkpoint):
    name, path, hf = checkpoint
    engine = _engine(path, num_blocks=64)
    cfg, kv = engine.model_config, engine.scheduler.kv_manager
    prompt = [(7 * i) % 290 + 3 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)
    request = engine.add_request(prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, sum(1 for b in request.block_ids if b))
    total = kv.num_blocks_for(len(prompt) + 60)
    if cfg.kv_free_window is None:   # Gemma 3, gpt-oss: global layers read everything, nothing is freed
        assert peak == total
    else:                            # Mistral: the window and one 16-token chunk at most
        assert peak <= kv.max_blocks_held(len(prompt) + 60, 16) < total
    assert engine.stats().kv_cache_usage == 0.0
    assert list(request.output_token_ids) == _hf_greedy(hf, prompt, 60)


def test_prefix_cache_hits_keep_outputs_equal(checkpoint):
    # A second turn extends the first (prompt + answer + more): a prefix hit, windowed for Mistral
    # (only the blocks its window reaches), full for the mixed models; outputs equal transformers'.
    name, path, hf = checkpoint
    engine = _engine(path, num_blocks=64)
    first = [(11 * i) % 280 + 5 for i in range(33)]
    answer = _greedy(engine, first, 8)
    second = first + answer + [17, 18, 19, 20, 21]
    hits_before = engine.scheduler.kv_manager.num_hit_tokens
    assert _greedy(engine, second, 10) == _hf_greedy(hf, second, 10)
    assert engine.scheduler.kv_manager.num_hit_tokens - hits_before >= 32
    assert engine.stats().kv_cache_usage == 0.0
