"""Random checkpoints of the sliding-window families (Mistral with a window, Gemma 3, gpt-oss),
written with `transformers` itself, windows shorter than the test prompts.

Draws on top of `hf_models.make_hf_model`'s: Gemma's norms store the offset from 1 and its tied
embedding is multiplied by sqrt(hidden), so both are drawn small (at std 1/sqrt(hidden) the input
embedding dominates the stream and greedy decoding repeats one token; 0.05 gives 8-15 distinct
tokens in 24); gpt-oss's experts are [E, in, out] matrices and its sinks O(1) logits, so they matter.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from tests.engine.hf_models import make_hf_model

WINDOW_CONFIGS = {
    # Mistral: one 9-token window in every layer (blocks behind it are freed), GQA 4:1.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=300, max_position_embeddings=512, sliding_window=9)),
    # Gemma 3: local/global interleaved (pattern 3: two local, one global), 7-token window, local
    # rope base, linear scaling on the global rope, query scale 1/sqrt(24), final softcap, GQA 2:1.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512,
        sliding_window=7, sliding_window_pattern=3, query_pre_attn_scalar=24, final_logit_softcapping=8.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=500.0)),
    # gpt-oss: sinks, sliding/full alternating (window 6), YaRN, 5 experts top-2 with biases and
    # the clamped SwiGLU (limit 1.5 so the clamp bites at this init), attention biases; MXFP4 needs
    # hidden and intermediate sizes in multiples of 32.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512,
        sliding_window=6, num_local_experts=5, num_experts_per_tok=2, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
}


def _init(name: str, p: torch.Tensor, gen: torch.Generator, gemma: bool) -> torch.Tensor | None:
    if name.endswith("norm.weight") and gemma:   # Gemma: the offset from 1
        return 0.1 * torch.randn(p.shape, generator=gen)
    if name.endswith("embed_tokens.weight") and gemma:   # x sqrt(64) = 8: an O(0.4) stream, O(1) logits
        return 0.05 * torch.randn(p.shape, generator=gen)
    if name.endswith("self_attn.sinks"):
        return torch.randn(p.shape, generator=gen)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):   # gpt-oss: [E, in, out]
        return torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
    return None


def make_window_model(name: str, out_dir: Path, seed: int = 0):
    """Write checkpoint `name` of `WINDOW_CONFIGS` to `out_dir`; returns the HF model (fp32)."""
    init = functools.partial(_init, gemma=name.startswith("gemma"))
    return make_hf_model(name, out_dir, seed, configs=WINDOW_CONFIGS, init=init)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., rows, cols]` -> (`blocks [..., rows, cols / 32, 16]`, `scales [..., rows, cols / 32]`)
    uint8, transformers' MXFP4 layout: per group of 32 a power-of-two scale so the largest value
    fits e2m1's 6.0, each value the nearest e2m1 code, the even column in the low nibble."""
    from engine.models.mxfp4 import FP4_VALUES, SCALE_BIAS

    groups = w.float().unflatten(-1, (-1, 32))                                  # [..., rows, G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)      # [..., rows, G]
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)   # [..., 32] in 0..15
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                          # [..., rows, G, 16]
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> None:
    """Rewrite the gpt-oss checkpoint at `src` into `dst` with MXFP4 experts, as OpenAI's release
    and transformers store them (`experts.{gate_up,down}_proj_{blocks,scales}` of the `[E, out, in]`
    weights; biases, attention, router and embeddings unquantized)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):     # transformers' [E, in, out]
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
