"""Self-attention over the paged KV cache: fused q/k/v projection, RoPE, KV write, paged kernel.

Options read from the config: q/k/v (and o) biases, and per-head RMSNorm of q and k before RoPE
(Qwen3's `q_norm` / `k_norm`, over `head_dim`, shared by every head). `head_dim` is the config's,
independent of `hidden_size / num_heads`. Per layer: its sliding window (`cfg.window(layer)`, 0 =
full; Mistral, Gemma 3's local layers, gpt-oss's sliding ones), the softmax scale
(`query_pre_attn_scalar ** -0.5` for Gemma, else `head_dim ** -0.5`) and gpt-oss's attention
sinks (`sinks [num_heads]`, this rank's heads). Window and sinks are kernel arguments, fixed per
layer, so a captured CUDA graph replays them as they are.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.linear import Linear
from engine.models.norm import RMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm=None,
                 layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.comm = comm   # tensor parallel: o_proj is row-parallel, its partial sums all-reduce
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias,
                               dtype=dtype, device=device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding_window = cfg.window(layer)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.num_heads, dtype=dtype, device=device), requires_grad=False)
        else:
            self.sinks = None
        # (k_scale, v_scale) of an fp8 KV cache (engine/kv_dtype.py): static, from the checkpoint or 1.0.
        self.kv_scales = (1.0, 1.0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)                                     # [T, q + 2 kv]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)                # [T, H, D]
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)             # [T, KVH, D]
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:                                # per head, before RoPE
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        k_scale, v_scale = self.kv_scales
        q, k = kernels.rope_and_write_kv(q, k, v, positions, rope_cache, key_cache, value_cache,
                                         meta.slot_mapping, k_scale, v_scale)   # one launch on CUDA
        out = kernels.paged_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, self.scale, k_scale, v_scale,
                                      self.sliding_window, self.sinks)  # [T, H, D]
        out = self.o_proj(out.reshape(-1, cfg.q_size))                # [T, hidden]
        return out if self.comm is None else self.comm.all_reduce(out)
