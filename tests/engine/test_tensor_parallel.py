"""Tensor parallelism on CPU (Gloo): TP=2 decodes the same greedy tokens as TP=1, with logprobs
within LOGPROB_TOLERANCE, on the tiny preset and on Llama/Mistral/Qwen2 checkpoints whose shapes
stress the split (fewer KV heads than ranks, GQA ratio 3, q/k/v/o biases, tied embeddings, a vocab
that does not divide by the ranks), and on Qwen3 and the mixtures of experts (every expert split
on its intermediate dim, the shared expert too, dense layers among MoE ones, both checkpoint
layouts); each rank holds and reads only its share.

Every TP=2 engine spawns one real rank subprocess; the test process is rank 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.presets import resolve_model_dir
from engine.sampling.params import SamplingParams
from engine.tp.shard import TensorParallelError, TPShard, check_divisible
from tests.engine.hf_models import make_hf_model

ROOT = Path(__file__).resolve().parents[2]
# fp32 sums in another order (the all-reduces add two partial matmuls): ~1e-6 relative in practice.
LOGPROB_TOLERANCE = 1e-3
# With an fp8 KV cache those ~1e-6 input differences can move a K/V element across an e4m3 rounding
# boundary (steps of 1/8 relative): measured up to 1.3e-3 on tiny.
FP8_KV_LOGPROB_TOLERANCE = 2e-2

TP_CONFIGS = {
    # Qwen2: q/k/v bias, tied embeddings (the head is the vocab-parallel embedding), head_dim 24, one
    # KV head for two ranks (replicated), vocab 301: rank 1's shard has one padding row.
    "qwen2_tied_kv1": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, vocab_size=301, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=1000.0)),
    # Llama: q/k/v/o biases (o's bias is added once, after the all-reduce), GQA ratio 3 (6 heads
    # over 2 KV heads: one KV head per rank), llama3 rope scaling.
    "llama_bias_gqa3": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, vocab_size=300, attention_bias=True, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # Qwen3-MoE: q/k norm with head_dim 24 (not hidden / heads), top-4 of 6 not renormalized,
    # per-expert tensors; layer 0 dense (mlp_only_layers).
    "qwen3_moe_k4": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, vocab_size=300, max_position_embeddings=512, num_experts=6,
        num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0])),
}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")   # the rank subprocesses read it


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {"tiny": resolve_model_dir("tiny")}
    root = tmp_path_factory.mktemp("tp-models")
    make_hf_model("mistral", root / "mistral")          # 4 heads over 1 KV head
    out["mistral"] = root / "mistral"
    for name in TP_CONFIGS:
        make_hf_model(name, root / name, configs=TP_CONFIGS)
        out[name] = root / name
    for name in ("mixtral", "qwen2_moe_packed"):        # 3 experts; shared expert, packed layout
        make_hf_model(name, root / name)
        out[name] = root / name
    return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    # 90 tokens > the 64-token step budget: a chunked prefill next to a short prompt, then decodes.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 90, 17)]


def _generate(path: Path, tp: int, prompts, kv_cache_dtype: str = "auto") -> list[tuple[list[int], list]]:
    engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=tp,
                                 cache=CacheConfig(num_blocks=64, kv_cache_dtype=kv_cache_dtype),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
        ids = [engine.add_request(p, params).request_id for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.new_logprobs
        return [(tokens[i], logprobs[i]) for i in ids]
    finally:
        engine.close()


@pytest.mark.parametrize("name, kv_cache_dtype", [("tiny", "auto"), ("mistral", "auto"), ("qwen2_tied_kv1", "auto"),
                                                   ("llama_bias_gqa3", "auto"), ("tiny", "fp8"),
                                                   ("mixtral", "auto"), ("qwen2_moe_packed", "auto"),
                                                   ("qwen3_moe_k4", "auto")])
def test_tp2_gives_the_same_greedy_tokens_and_logprobs_as_tp1(checkpoints, name, kv_cache_dtype):
    path = checkpoints[name]
    prompts = _prompts(ModelConfig.from_dir(path).vocab_size)
    one, two = _generate(path, 1, prompts, kv_cache_dtype), _generate(path, 2, prompts, kv_cache_dtype)
    tolerance = FP8_KV_LOGPROB_TOLERANCE if kv_cache_dtype == "fp8" else LOGPROB_TOLERANCE
    for (tokens1, lps1), (tokens2, lps2) in zip(one, two):
        assert tokens2 == tokens1
        for lp1, lp2 in zip(lps1, lps2):
            assert abs(lp1.logprob - lp2.logprob) <= tolerance
            assert [t for t, _ in lp1.top] == [t for t, _ in lp2.top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(lp1.top, lp2.top)) <= tolerance


def test_each_rank_loads_only_its_share(checkpoints):
    path = checkpoints["qwen2_tied_kv1"]
    cfg = ModelConfig.from_dir(path)
    full = load_model(path, cfg, torch.float32, torch.device("cpu"))
    comm = object()   # never called: no forward here
    ranks = [load_model(path, cfg, torch.float32, torch.device("cpu"), shard=TPShard(cfg, r, 2), comm=comm)
             for r in range(2)]
    q, kv, d = cfg.q_size, cfg.kv_size, cfg.head_dim
    for r, model in enumerate(ranks):
        attn = model.layers[0].self_attn
        assert model.cfg.num_heads == 2 and model.cfg.num_kv_heads == 1
        assert attn.qkv_proj.weight.shape == (2 * d + 2 * d, cfg.hidden_size)
        full_qkv = full.layers[0].self_attn.qkv_proj.weight
        # q rows of this rank's two heads; the one KV head is replicated on both ranks.
        torch.testing.assert_close(attn.qkv_proj.weight[:2 * d], full_qkv[r * 2 * d:(r + 1) * 2 * d])
        torch.testing.assert_close(attn.qkv_proj.weight[2 * d:3 * d], full_qkv[q:q + kv])
        full_o = full.layers[0].self_attn.o_proj.weight
        torch.testing.assert_close(attn.o_proj.weight, full_o[:, r * 2 * d:(r + 1) * 2 * d])
        assert model.embed_tokens.weight.shape == (151, cfg.hidden_size)
    torch.testing.assert_close(torch.cat([m.embed_tokens.weight for m in ranks])[:cfg.vocab_size],
                               full.embed_tokens.weight)
    assert not ranks[1].embed_tokens.weight[-1].any()   # the padding row past the vocab


@pytest.mark.parametrize("name", ["qwen2_moe_packed", "qwen3_moe_k4"])
def test_each_rank_loads_its_slice_of_every_expert(checkpoints, name):
    path = checkpoints[name]
    cfg = ModelConfig.from_dir(path)
    full = load_model(path, cfg, torch.float32, torch.device("cpu"))
    ranks = [load_model(path, cfg, torch.float32, torch.device("cpu"), shard=TPShard(cfg, r, 2), comm=object())
             for r in range(2)]
    i, half = cfg.moe_intermediate_size, cfg.moe_intermediate_size // 2
    layer = next(n for n in range(cfg.num_layers) if cfg.is_moe_layer(n))
    whole = full.layers[layer].mlp
    for r, model in enumerate(ranks):
        moe = model.layers[layer].mlp
        rows = slice(r * half, (r + 1) * half)
        gate_up = whole.experts.gate_up_proj
        torch.testing.assert_close(moe.experts.gate_up_proj,
                                   torch.cat([gate_up[:, :i][:, rows], gate_up[:, i:][:, rows]], dim=1))
        torch.testing.assert_close(moe.experts.down_proj, whole.experts.down_proj[:, :, rows])
        torch.testing.assert_close(moe.gate.weight, whole.gate.weight)          # the router is whole
        if cfg.shared_expert_intermediate_size:
            s = cfg.shared_expert_intermediate_size // 2
            torch.testing.assert_close(moe.shared_expert.down_proj.weight,
                                       whole.shared_expert.down_proj.weight[:, r * s:(r + 1) * s])
            torch.testing.assert_close(moe.shared_expert_gate.weight, whole.shared_expert_gate.weight)


def test_kv_heads_are_split_or_replicated_to_the_ranks_whose_queries_read_them():
    cfg = ModelConfig.from_dir(resolve_model_dir("tiny"))     # 4 heads, 2 KV heads
    assert [TPShard(cfg, r, 2).kv_heads for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [TPShard(cfg, r, 4).kv_heads for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    for r in range(4):   # query head h reads KV head h // (heads per KV head)
        shard = TPShard(cfg, r, 4)
        assert {h // 2 for h in shard.q_heads} == set(shard.kv_heads)
    with pytest.raises(TensorParallelError, match="num_attention_heads \\(4\\) must be divisible"):
        check_divisible(cfg, 3)


def test_generate_cli_at_tp2_prints_the_tp1_text_and_refuses_bad_sizes():
    env = {"CBSERVE_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "cbserve.cli", "--log-level", "WARNING", "generate", "--prompt", "Hello",
            "--max-tokens", "8"]
    proc = subprocess.run([*base, "--tensor-parallel-size", "2"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = Engine(EngineConfig(model="tiny"))
    (expected,) = engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))
    assert proc.stdout == expected.text + "\n"
    bad = subprocess.run([*base, "--tensor-parallel-size", "3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert "num_attention_heads (4) must be divisible by tensor_parallel_size (3)" in bad.stderr


def test_the_ranks_meet_through_a_private_file_not_a_listener():
    """The rendezvous store is a FileStore in a 0700 directory of rank 0's, gone once the group
    closes: no TCPStore port that any local process could reach."""
    import os
    import stat

    engine = Engine(EngineConfig(model="tiny", tensor_parallel_size=2, cache=CacheConfig(num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    store_dir = engine.tp.store_dir
    try:
        assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
        assert os.stat(store_dir).st_uid == os.getuid()
    finally:
        engine.close()
    assert not os.path.exists(store_dir)
