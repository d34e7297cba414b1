"""Pure-torch KV cache write: the reference for the Triton kernel and the CPU runtime path.

An fp8 cache (float8_e4m3fn) stores ``x * (1 / scale)`` clamped to e4m3's finite range
(+-448) and rounded to nearest; the Triton kernels multiply by the same fp32 reciprocal, so both
backends write the same bytes. CPU torch has no ``index_copy_`` for fp8: the cache is written
through a uint8 view of the same bytes.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any float dtype) -> float8_e4m3fn holding ``x / scale``, saturated to +-448."""
    return x.float().mul(1.0 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _as_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A contiguous 2-D alias ``[rows, num_kv_heads * head_dim]`` of the storage under ``cache``
    and the row distance between blocks, or None if one token's heads are not one dense row.

    The engine's per-layer views (``kv[:, l, 0]``) are strided over blocks but dense within a
    block; through this alias one ``index_copy_`` scatters all tokens. Rows between this layer's
    blocks (other layers, the value half) are never indexed.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = num_kv_heads * head_dim
    if cache.stride()[1:] != (row, head_dim, 1) or cache.stride(0) % row:
        return None
    block_rows = cache.stride(0) // row
    num_rows = (num_blocks - 1) * block_rows + block_size  # ends at the view's last element
    return cache.as_strided((num_rows, row), (row, 1)), block_rows


def _write(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor,
           scale: float) -> None:
    # blocks, offsets: [T] int64; x: [T, num_kv_heads, head_dim]
    if cache.dtype is FP8:  # quantize, then move bytes (no fp8 index_copy_ on CPU)
        cache, x = cache.view(torch.uint8), quantize_kv(x, scale).view(torch.uint8)
    alias = _as_rows(cache)
    if alias is None:  # unusual layout: advanced indexing (slower, but any strides)
        cache[blocks, offsets] = x
        return
    rows, block_rows = alias
    rows.index_copy_(0, blocks * block_rows + offsets, x.reshape(x.shape[0], rows.shape[1]))  # T may be 0


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K/V into its slot; tokens with slot -1 (padding) are skipped. An fp8
    cache gets ``K / k_scale`` and ``V / v_scale`` (the scales are ignored for float caches)."""
    block_size = key_cache.shape[1]
    # Padding is rare (the engine never pads): only then pay for the boolean selection.
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    _write(key_cache, blocks, offsets, key, k_scale)
    _write(value_cache, blocks, offsets, value, v_scale)
