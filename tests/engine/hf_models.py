"""Random Hugging Face checkpoints for equivalence tests, written with `transformers` itself.

Weights are re-drawn at O(1/sqrt(fan_in)) scale so the logits are peaked: with transformers'
default 0.02 init every logit is nearly equal and greedy argmax would hinge on rounding noise
(the same holds for the routers of mixtures of experts: peaked router logits keep the top-k
choice away from ties). A config may name `save_pretrained` options as a fourth element:
`save_original_format=False` writes transformers 5's packed expert tensors instead of the
per-expert ones it writes by default.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

CONFIGS = {
    # Llama with GQA (4 heads over 2 KV heads), head_dim 16, llama3 rope scaling.
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Qwen2: qkv bias, head_dim 32, one KV head.
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32, vocab_size=320, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000.0)),
    # Tied embeddings, head_dim 8, linear rope scaling, MHA.
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=280, max_position_embeddings=512, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Mistral: GQA, head_dim 16.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=300, max_position_embeddings=512, sliding_window=None)),
    # Qwen3: q/k norm, head_dim 24 independent of hidden / heads (= 16), GQA, q/k/v/o biases.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, vocab_size=300, max_position_embeddings=512,
        attention_bias=True, rope_theta=10000.0)),
    # Mixtral: an odd number of experts (3), top-2, renormalized.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, num_local_experts=3,
        num_experts_per_tok=2)),
    # Qwen2-MoE: top-3 of 5, not renormalized, a shared expert, layer 1 dense (mlp_only_layers),
    # experts narrower than the dense MLP; saved packed (gate_up_proj [E, 2I, H]).
    "qwen2_moe_packed": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, num_experts=5,
        num_experts_per_tok=3, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        norm_topk_prob=False, mlp_only_layers=[1]), dict(save_original_format=False)),
    # Qwen3-MoE: top-1 of 4 (renormalized: every weight 1), q/k norm, decoder_sparse_step 2 (layers
    # 0 and 2 dense, layer 1 MoE).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512, num_experts=4,
        num_experts_per_tok=1, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2)),
}


def make_hf_model(name: str, out_dir: Path, seed: int = 0, configs: dict | None = None, init=None):
    """Write checkpoint `name` of `configs` (default `CONFIGS`) to `out_dir`; returns the HF model.

    `init(name, param, generator)`: a family's own draw for a parameter (a tensor), or None for
    the default below."""
    config_cls, model_cls, kwargs, *save = (configs or CONFIGS)[name]
    config = getattr(transformers, config_cls)(bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            drawn = None if init is None else init(pname, p, gen)
            if drawn is not None:
                p.copy_(drawn)
            elif p.dim() >= 2:    # matrices; [E, out, in] expert stacks
                std = 1.0 if "embed_tokens" in pname else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True, **(save[0] if save else {}))
    return model


def make_eagle_head(target_dir: Path, out_dir: Path, seed: int = 0, num_layers: int = 1,
                    drop: tuple[str, ...] = (), **overrides) -> Path:
    """A random-weight EAGLE-1 head for the Llama checkpoint at `target_dir`, in the layout vLLM
    loads (`engine.spec_decode.eagle_head`): the target's config.json with `num_layers` layers,
    `fc.weight` [H, 2H] and the decoder layers' tensors, without layer 0's input norm, the
    embedding, the final norm or the lm_head. `drop`: tensor names left out; `overrides`: config keys."""
    import json

    from safetensors.torch import save_file

    raw = json.loads((target_dir / "config.json").read_text())
    raw.update(num_hidden_layers=num_layers, **overrides)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    layers = transformers.LlamaModel(cfg).layers
    tensors = {f"layers.{name}": t.detach().contiguous() for name, t in layers.state_dict().items()
               if name != "0.input_layernorm.weight"}
    tensors["fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size) / math.sqrt(2 * cfg.hidden_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    return out_dir
