"""Pure-torch RoPE followed by the KV cache write: the reference for the fused Triton kernel and
the CPU path. It is the two references composed, so the fused kernel must match the two calls."""

from __future__ import annotations

import torch

from kernels.kv_write_ref import write_kv_ref
from kernels.rope_ref import apply_rope_ref


def rope_and_write_kv_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope_ref`` then ``write_kv_ref`` of the rotated keys; returns the rotated (q, k)."""
    q_rot, k_rot = apply_rope_ref(q, k, positions, cos_sin_cache)
    write_kv_ref(k_rot, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return q_rot, k_rot
