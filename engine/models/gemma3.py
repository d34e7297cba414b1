"""Gemma 3 (text): `Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`.

What differs from Llama, as transformers' `modeling_gemma3.py` computes it:
- RMSNorm scales by `1 + weight` (stored weights are the offset from 1), in fp32, rounded once;
  four per layer: before and after attention, before and after the MLP, so each sublayer's output
  is normed before the residual add (nothing fuses with the add, unlike Llama's pre-norm).
- q and k get that norm per head (over `head_dim`) before RoPE; the softmax scale is
  `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`.
- Local (sliding-window) and global layers interleave (`layer_types`, or every
  `sliding_window_pattern`-th layer global); local layers rotate with their own base
  (`rope_local_base_freq`, 10k), global ones with `rope_theta` and its scaling.
- The embedding is multiplied by `sqrt(hidden_size)` (rounded to the model dtype first); the MLP
  is GeGLU (tanh GELU); the final logits are soft-capped when `final_logit_softcapping` is set.
  `attn_logit_softcapping` is not applied (transformers' Gemma 3 attention ignores it too).

A multimodal checkpoint loads its language model only (`language_model.*`; the vision tower
and projector are skipped): cbserve serves text.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.attention import Attention
from engine.models.causal_lm import CausalLM
from engine.models.mlp import MLP
from engine.rope import cos_sin_cache


class GemmaRMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * (1 + weight)` in fp32, rounded once to x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., size] -> [..., size]` normalized over the last dim."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device, comm=None) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, comm, layer)
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps, dtype, device)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = MLP(hidden, cfg.intermediate_size, dtype, device, comm, activation=cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: None, positions: torch.Tensor, rope_cache: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        """x: the residual stream [T, hidden] -> (the stream after this layer, None)."""
        h = self.self_attn(self.input_layernorm.norm(x), positions, rope_cache, key_cache, value_cache, meta)
        x = x + self.post_attention_layernorm.norm(h)
        h = self.mlp(self.pre_feedforward_layernorm.norm(x))
        return x + self.post_feedforward_layernorm.norm(h), None


class Gemma3ForCausalLM(CausalLM):
    # Multimodal checkpoints: transformers 5 `model.language_model.*`, 4.x `language_model.model.*`.
    hf_renames = ((r"^language_model\.model\.", ""), (r"^language_model\.", ""))
    hf_ignored = (r"^vision_tower\.", r"^multi_modal_projector\.")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_position: int | None = None, shard=None, comm=None) -> None:
        super().__init__(cfg, dtype, device, max_position, shard=shard, comm=comm)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        local = cos_sin_cache(cfg.local_rope or cfg.rope, cfg.head_dim, max_position or cfg.max_position_embeddings,
                              device)
        self.register_buffer("local_rope_cache", local, persistent=False)  # [max_position, head_dim] fp32
        # transformers rounds sqrt(hidden) to the embedding's dtype before the multiply.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device),
                             persistent=False)
        self.requires_grad_(False)

    def make_layer(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                   comm) -> nn.Module:
        return Gemma3DecoderLayer(cfg, layer, dtype, device, comm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, num_layers, 2, block_size, KVH, D]
        (with KV groups `[num_blocks, slots, ...]`, `CausalLM.use_kv_groups`).
        Returns the final hidden states `[T, hidden]` (normed)."""
        x = self.embed_tokens(input_ids) * self.embed_scale        # [T, hidden]
        cfg, metas = self.cfg, (meta, *meta.group_metas)
        for i, (layer, (group, slot)) in enumerate(zip(self.layers, self.kv_place)):
            rope = self.local_rope_cache if cfg.window(i) else self.rope_cache
            x, _ = layer(x, None, positions, rope, kv_cache[:, slot, 0], kv_cache[:, slot, 1], metas[group])
        return self.norm.norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)               # [N, vocab]
        cap = self.cfg.final_logit_softcapping
        if cap:   # in place: a CUDA graph's logits buffer stays the one it captured
            logits.div_(cap).tanh_().mul_(cap)
        return logits
