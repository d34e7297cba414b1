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
from engine.sampling.params import SamplingParams
from tests.engine.hf_window_models import WINDOW_CONFIGS, make_window_model
from tests.engine.test_hf_equivalence import (check_against_transformers, transformers_greedy,
                                             transformers_next_token_logits)


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


def _is_hf_greedy(hf, prompt: list[int], ours: list[int]) -> bool:
    return transformers_greedy(hf, transformers_next_token_logits(hf, prompt, ours)) == ours


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


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_pd_handoff_moves_only_the_window_and_equals_colocated(checkpoint, mode):
    """P/D in one process (tests/engine/pd_handoff.py) equals colocated for prompts several windows
    long. Every layer windowed (Mistral): the pull moves, and the decode engine reserves, only the
    blocks from `first_block_in_window(prompt)` on, and the prefill engine frees behind the window
    as it goes; mixed local/global (Gemma 3, gpt-oss, KV groups of one layer per page): the full
    layer's page of every block and each local layer's pages from its window's start."""
    from tests.engine.pd_handoff import run_disaggregated

    name, path, _ = checkpoint
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 290) for _ in range(n)] for n in (61, 30, 7)]
    params = (SamplingParams(temperature=0.0, max_tokens=12) if mode == "greedy"
              else SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12))
    want = [o.output_token_ids for o in _engine(path, num_blocks=64).generate(prompts, params)]
    engines = [Engine(EngineConfig(model=str(path), role=role, cache=CacheConfig(block_size=4, num_blocks=64),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)))
               for role in ("prefill", "decode")]
    copied: dict[str, int] = {}
    assert run_disaggregated(*engines, prompts, params, copied) == want
    window = engines[1].model_config.kv_free_window
    assert (window is not None) == (name == "mistral_window")
    # Mistral (window 9): the 61-token prompt's query at 61 reads keys 53..61, blocks 13..15: 3 of 16.
    # Gemma 3 (1 global + 4 local layers, window 7): the 61-token prompt moves 16 global pages and
    # 3 per local layer (keys 55..61, blocks 13..15); gpt-oss (1 full + 2 sliding, window 6): 16 + 2 x 2.
    expected = {"mistral_window": [3, 3, 2], "gemma3": [16 + 4 * 3, 8 + 4 * 2, 2 + 4 * 2],
                "gpt_oss": [16 + 2 * 2, 8 + 2 * 2, 2 + 2 * 2]}[name]
    assert [copied[f"r{i}"] for i in range(3)] == expected
    for i in range(3):   # the pulls are over: the prefill engine lets the held blocks go
        assert engines[0].scheduler.release_request(f"r{i}")
    for engine in engines:
        assert engine.stats().kv_cache_usage == 0.0
        engine.scheduler.check_invariants()


def test_a_windowed_model_frees_the_blocks_behind_its_window(checkpoint):
    name, path, hf = checkpoint
    engine = _engine(path, num_blocks=64)
    cfg, kv = engine.model_config, engine.scheduler.kv_manager
    prompt = [(7 * i) % 290 + 3 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)
    request = engine.add_request(prompt, params)
    peak, local_peak = 0, [0] * (kv.num_groups - 1)
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, sum(1 for b in request.block_ids if b))
        if not request.is_finished and kv.groups is not None:
            local_peak = list(map(max, local_peak, kv.groups.num_held(request.request_id)))
    total = kv.num_blocks_for(len(prompt) + 60)
    if cfg.kv_free_window is None:   # Gemma 3, gpt-oss: the global group (the full layers) keeps every block,
        assert peak == total         # each local group a window and one 16-token chunk at most
        assert kv.groups.windows and all(0 < n <= kv.groups.max_blocks_held(total, 16) // len(local_peak) < total
                                         for n in local_peak)
    else:                            # Mistral: the window and one 16-token chunk at most
        assert peak <= kv.max_blocks_held(len(prompt) + 60, 16) < total
    assert engine.stats().kv_cache_usage == 0.0
    assert _is_hf_greedy(hf, prompt, list(request.output_token_ids))


def test_prefix_cache_hits_keep_outputs_equal(checkpoint):
    # A second turn extends the first (prompt + answer + more): a prefix hit, windowed for Mistral
    # (only the blocks its window reaches), full for the mixed models; outputs equal transformers'.
    name, path, hf = checkpoint
    engine = _engine(path, num_blocks=64)
    first = [(11 * i) % 280 + 5 for i in range(33)]
    answer = _greedy(engine, first, 8)
    second = first + answer + [17, 18, 19, 20, 21]
    hits_before = engine.scheduler.kv_manager.num_hit_tokens
    assert _is_hf_greedy(hf, second, _greedy(engine, second, 10))
    assert engine.scheduler.kv_manager.num_hit_tokens - hits_before >= 32
    assert engine.stats().kv_cache_usage == 0.0


def test_padded_decode_step_equals_the_unpadded_one(checkpoint):
    """The CUDA-graph path's logic on CPU (decode batches padded to a bucket, windows and sinks as
    fixed per-layer arguments): the same logits and KV as the eager step, with the entries behind
    a window freed (the null block) where the model frees them."""
    from engine.kv_cache import allocate_kv_cache
    from engine.loader import load_model
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner
    from engine.scheduling.output import ScheduledSeq

    from engine.kv_groups.spec import KVGroups

    name, path, hf = checkpoint
    cfg, cpu, bs = ModelConfig.from_dir(path), torch.device("cpu"), 4
    groups = KVGroups.for_windows(cfg.layer_windows, cfg.num_layers)   # Gemma 3, gpt-oss: tables per group
    runners = []
    for eager in (True, False):
        model = load_model(path, cfg, torch.float32, cpu)
        model.use_kv_groups(groups)
        runners.append(ModelRunner(model, allocate_kv_cache(cfg, 80 * groups.num_groups, bs, torch.float32, cpu,
                                                            groups.slots),
                                   bs, cpu, max_num_seqs=16, max_model_len=64, enforce_eager=eager))
    for runner in runners:
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    batch, first, group_tables = [], 1, {}
    for i, start in enumerate([3, 20, 33, 12, 41]):
        tables = []
        for window in groups.windows:   # every group's pages apart, null behind its window
            table = list(range(first, first + start // bs + 1))
            first += len(table)
            if window:
                behind = max(0, start - window + 1) // bs
                table[:behind] = [0] * behind
            tables.append(tuple(table))
        batch.append(ScheduledSeq(f"r{i}", (10 + i,), start, tables[0], True))
        group_tables[f"r{i}"] = tuple(tables[1:])
    for runner in runners:
        runner.read_group_tables(group_tables)
    eager, padded = runners
    assert padded.decode_buckets.bucket(batch) is not None
    got, want = padded.run(batch), eager.run(batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.kv_cache, eager.kv_cache)


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("int8", "auto"), ("fp8", "auto"), (None, "fp8")])
def test_quantized_weights_and_fp8_kv_stay_close(checkpoint, quantization, kv_cache_dtype):
    # W8A8 int8 / e4m3 fp8 linears (the CPU references of their GPU paths) and an fp8 KV cache
    # compose with windows, sinks and Gemma's norms: the prompt's next-token distribution stays close.
    # gpt-oss's experts are fp8 per channel with their biases in the model dtype; int8 refuses them.
    name, path, hf = checkpoint
    prompt = [(13 * i) % 290 + 4 for i in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    config = EngineConfig(model=str(path), quantization=quantization,
                          cache=CacheConfig(block_size=4, num_blocks=40, kv_cache_dtype=kv_cache_dtype))
    if quantization == "int8" and name == "gpt_oss":
        with pytest.raises(ValueError, match="int8 does not cover mixture-of-experts"):
            Engine(config)
        return

    def first(engine: Engine):
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_logprobs:
                    return out.new_token_ids[0], dict(out.new_logprobs[0].top)

    plain_token, plain_top = first(_engine(path))
    token, top = first(Engine(config))
    # Random tiny models have close logits, so the argmax may flip; its probability barely moves.
    # An MoE's routing amplifies fp8's per-weight error (a changed top-k sends a token elsewhere).
    bound = 1.0 if name == "gpt_oss" and quantization == "fp8" else 0.1
    assert plain_token in top and abs(top[plain_token] - plain_top[plain_token]) < bound


def test_gpt_oss_fp8_experts_keep_their_biases_within_the_per_channel_bound(tmp_path):
    from engine.fp8 import FP8, quantize_model_fp8
    from engine.loader import load_model
    from engine.model_config import ModelConfig

    make_window_model("gpt_oss", tmp_path)
    model = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"))
    experts = model.layers[0].mlp.experts
    x = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(1)).softmax(-1)
    ids = torch.stack([torch.randperm(5, generator=torch.Generator().manual_seed(i))[:2] for i in range(9)])
    want = experts(x, weights, ids)
    quantize_model_fp8(model)
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_proj_bias.dtype == torch.float32
    got = experts(x, weights, ids)
    assert float((got - want).norm() / want.norm()) < 0.06   # e4m3: 3 mantissa bits, per output channel


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """gpt-oss with MXFP4 experts, written here in transformers' layout, and transformers' own
    model of it (which dequantizes on a CPU)."""
    import transformers

    from tests.engine.hf_window_models import write_mxfp4_checkpoint

    src, dst = tmp_path_factory.mktemp("gpt_oss_float"), tmp_path_factory.mktemp("gpt_oss_mxfp4")
    make_window_model("gpt_oss", src)
    write_mxfp4_checkpoint(src, dst)
    hf = transformers.GptOssForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    return dst, hf


def test_mxfp4_experts_load_as_transformers_reads_them(gpt_oss_mxfp4):
    from safetensors import safe_open

    from engine.loader import load_model
    from engine.model_config import ModelConfig

    path, hf = gpt_oss_mxfp4
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in f.keys()
        assert "model.layers.0.mlp.experts.gate_up_proj" not in f.keys()
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
    ours, theirs = model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    inter = theirs.gate_up_proj.shape[2] // 2
    # transformers: [E, H, 2I] interleaved, x @ W; ours: [E, 2I, H] gate rows then up rows.
    assert torch.equal(ours.gate_up_proj[:, :inter], theirs.gate_up_proj[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.gate_up_proj[:, inter:], theirs.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(ours.down_proj, theirs.down_proj.transpose(1, 2))
    assert torch.equal(ours.gate_up_proj_bias[:, :inter], theirs.gate_up_proj_bias[:, 0::2])


def test_mxfp4_checkpoint_equals_transformers(gpt_oss_mxfp4):
    path, hf = gpt_oss_mxfp4
    check_against_transformers("gpt_oss_mxfp4", _engine(path, num_blocks=60), hf)
