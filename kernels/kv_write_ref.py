"""Pure-torch KV cache write: the reference for the Triton kernel and the CPU runtime path."""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset, -1 = skip
) -> None:
    """Scatter each token's K/V into its slot; tokens with slot -1 (padding) are skipped."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indexing on the (possibly strided) view writes through to the shared allocation.
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]
