"""A Llama checkpoint that copies from its prompt: a hand-built induction circuit, for speculative-decoding benchmarks.

Prompt lookup (n-gram drafts) pays where the output repeats the prompt, and a random-weight preset
never does that; training a copying model on this CPU did not converge. So the circuit is built by
hand, as in Olsson et al.'s induction heads, inside an ordinary `LlamaForCausalLM` that cbserve and
`transformers` load like any checkpoint (safetensors, config.json, the presets' byte-level tokenizer).

The residual stream holds four parts: `tok` (the token's code `u_t`, random unit vectors in `c`
dimensions), `prev` (the previous token's code), `out` (the predicted next token's code), and one
constant dimension. `c = 64 * n` for `n` slices of one head's width.

- **Layer 0, previous-token heads** (one per slice): query and key are built from the constant
  dimension only and live in the fastest RoPE pairs. The key's pair `k` is the query's turned by
  one position's angle `theta_k`, so the score at distance `d` is `A * sum_k cos((d - 1) theta_k)`.
  It peaks at `d = 1`, and the several frequencies keep any farther distance from aliasing onto it.
  The value is the slice of `tok`, and the output writes it into `prev`.
- **Layer 1, induction heads** (`heads // n` per slice): the query is `tok` and the key is `prev`,
  through the same random orthonormal projection into the *slowest* RoPE pairs. At these lengths
  those barely turn, so the score is position-free. A position scores high when the token before
  it equals the current token. The value is that position's `tok` slice, and the output writes it
  into `out`.
- **`lm_head`** reads `out` against every token's code, so the greedy continuation of `... a b ... a`
  is `b`. A prompt `D + D[:m]` (with `D` of distinct tokens) is continued by `D[m:]`, then `D` again.
- **Everything else is real work** with random weights: the other heads, every MLP, and layers 2 and
  up. Their outputs are scaled small, so the circuit dominates the logits and the matmuls cost what
  a model of this shape costs.

    .venv/bin/python bench/copy_model.py --shape copy --check   # builds it, checks cbserve == transformers

`rope_theta` is 1e8 so that a 64-wide head has both fast pairs (layer 0) and nearly still ones
(layer 1). `build(shape)` writes the directory once, under the presets' cache.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SHAPES: dict[str, dict] = {
    # tiny-like cost (a few M parameters), wide enough for 3 slices of codes
    "copy": dict(hidden_size=640, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=10,
                 vocab_size=None, seed=7),
    # the `small` preset's shape (hidden 1024, 12 layers, 16 heads, 32k vocab); no GQA so every head has its keys
    "copy-small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                       vocab_size=32000, seed=8),
}
HEAD_DIM = 64
ROPE_THETA = 1e8
FAST_PAIRS = 5          # RoPE pairs of the previous-token heads: angles 1, .56, .32, .18, .1 per position
SLOW_FROM = 15          # pairs >= this turn by < 2e-4 rad per position: the induction heads' pairs
PREV_SCORE = 20.0       # per fast pair: the previous position beats its neighbours by ~0.7 * 5 * this
INDUCTION_SCORE = 40.0  # score of the matching position (others: ~N(0, 0.17) times this)
LOGIT = 20.0            # logit of the copied token (others: ~N(0, 1/sqrt(c)) times this)
NOISE = 0.01            # output scale of the random (non-circuit) weights
FORMAT = 1


def model_dir(shape: str) -> Path:
    from engine.presets import cache_dir

    return cache_dir() / "models" / f"{shape}-v{FORMAT}"


def build(shape: str) -> Path:
    """The checkpoint directory of `shape` (written on first use)."""
    path = model_dir(shape)
    if (path / "model.safetensors").is_file():
        return path
    from safetensors.torch import save_file

    from engine.tokenizer import Tokenizer, build_byte_level_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    p = SHAPES[shape]
    build_byte_level_tokenizer(path, vocab_size=p["vocab_size"])
    vocab = p["vocab_size"] or Tokenizer.from_pretrained(path).vocab_size
    heads = p["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": p["hidden_size"], "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"], "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": HEAD_DIM, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": ROPE_THETA,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    tensors = _weights(config, p["seed"])
    save_file(tensors, str(path / "model.safetensors.tmp"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "model.safetensors.tmp").replace(path / "model.safetensors")
    return path


def _weights(cfg: dict, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    d, inter, vocab, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    n = (d - 1) // (3 * HEAD_DIM)                 # slices per part
    c = n * HEAD_DIM
    tok, prev, out, const = slice(0, c), slice(c, 2 * c), slice(2 * c, 3 * c), 3 * c
    half = HEAD_DIM // 2

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * (scale / math.sqrt(shape[-1]))

    codes = torch.randn(vocab, c, generator=gen)
    codes /= codes.norm(dim=1, keepdim=True)      # u_t
    embed = torch.zeros(vocab, d)
    embed[:, tok], embed[:, const] = codes, 1.0
    t = {"model.embed_tokens.weight": embed}

    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        q, k, v = rand(heads * HEAD_DIM, d), rand(heads * HEAD_DIM, d), rand(heads * HEAD_DIM, d)
        o = rand(d, heads * HEAD_DIM, scale=NOISE)
        if layer == 0:        # residual [u_t, 0, 0, 1] -> normed by sqrt(d / 2)
            norm = math.sqrt(d / 2)
            amp = math.sqrt(PREV_SCORE * math.sqrt(HEAD_DIM)) / norm   # q and k per fast pair, from const
            for h in range(n):
                rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                q[rows], k[rows], v[rows], o[:, rows] = 0, 0, 0, 0
                for j in range(FAST_PAIRS):
                    theta = float(inv_freq[j])
                    q[h * HEAD_DIM + j, const] = amp
                    k[h * HEAD_DIM + j, const] = amp * math.cos(theta)
                    k[h * HEAD_DIM + half + j, const] = amp * math.sin(theta)
                v[rows, tok.start + h * HEAD_DIM:tok.start + (h + 1) * HEAD_DIM] = torch.eye(HEAD_DIM)
                o[prev.start + h * HEAD_DIM:prev.start + (h + 1) * HEAD_DIM, rows] = torch.eye(HEAD_DIM) / norm
        elif layer == 1:      # residual [u_t, u_prev, 0, 1] -> normed by sqrt(d / 3)
            norm = math.sqrt(d / 3)
            slow = [j for j in range(SLOW_FROM, half)] + [half + j for j in range(SLOW_FROM, half)]
            per_slice = heads // n
            for h in range(n * per_slice):
                rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                s = h % n
                proj = torch.linalg.qr(torch.randn(c, len(slow), generator=gen))[0].T   # [slow, c], orthonormal rows
                # match: u^T P^T P u ~ len(slow) / c, scaled to INDUCTION_SCORE after 1/sqrt(head_dim)
                amp = math.sqrt(INDUCTION_SCORE * math.sqrt(HEAD_DIM) * c / len(slow)) / norm
                q[rows], k[rows], v[rows], o[:, rows] = 0, 0, 0, 0
                q[[h * HEAD_DIM + j for j in slow], tok] = amp * proj
                k[[h * HEAD_DIM + j for j in slow], prev] = amp * proj
                v[rows, tok.start + s * HEAD_DIM:tok.start + (s + 1) * HEAD_DIM] = torch.eye(HEAD_DIM)
                o[out.start + s * HEAD_DIM:out.start + (s + 1) * HEAD_DIM, rows] = torch.eye(HEAD_DIM) / (norm * per_slice)
        t.update({
            pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
            pre + "self_attn.v_proj.weight": v, pre + "self_attn.o_proj.weight": o,
            pre + "mlp.gate_proj.weight": rand(inter, d), pre + "mlp.up_proj.weight": rand(inter, d),
            pre + "mlp.down_proj.weight": rand(d, inter, scale=NOISE),
            pre + "input_layernorm.weight": torch.ones(d), pre + "post_attention_layernorm.weight": torch.ones(d),
        })
    t["model.norm.weight"] = torch.ones(d)
    head = torch.zeros(vocab, d)                 # residual ~[u_t, u_prev, u_next, 1] -> normed by sqrt(d / 4)
    head[:, out] = codes * (LOGIT / math.sqrt(d / 4))
    head[:, 3 * c + 1:] = rand(vocab, d - 3 * c - 1, scale=NOISE)
    t["lm_head.weight"] = head
    return {name: w.float().contiguous() for name, w in t.items()}


def copy_prompts(batch: int, seed: int, doc_len: int = 100, shown: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """`BOS + D + D[:shown]` per request (`D`: `doc_len` distinct byte tokens), and the copy each
    should continue with (`D[shown:] + D + ...`)."""
    import random

    rng = random.Random(seed)
    prompts, expected = [], []
    for _ in range(batch):
        doc = rng.sample(range(4, 260), doc_len)
        prompts.append([1] + doc + doc[:shown])
        expected.append((doc[shown:] + doc * 8))
    return prompts, expected


def check(shape: str, max_tokens: int = 48, batch: int = 4) -> None:
    """cbserve's greedy output equals transformers' and is the copy."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.engine import Engine, EngineConfig
    from engine.sampling.params import SamplingParams

    path = build(shape)
    prompts, expected = copy_prompts(batch, seed=123)
    engine = Engine(EngineConfig(model=str(path), detokenize=False))
    ours = [o.output_token_ids for o in engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, mine, want in zip(prompts, ours, expected):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens)[0, len(prompt):].tolist()
        copied = sum(a == b for a, b in zip(mine, want[:max_tokens]))
        print(f"cbserve == transformers: {mine == theirs}; copies its prompt: {copied}/{max_tokens}")
        assert mine == theirs, (mine, theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="copy")
    parser.add_argument("--check", action="store_true", help="compare cbserve's greedy output with transformers'")
    args = parser.parse_args()
    print(build(args.shape))
    if args.check:
        check(args.shape)


if __name__ == "__main__":
    main()
