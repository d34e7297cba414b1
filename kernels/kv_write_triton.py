"""Triton KV cache write: one program per token copies its K and V heads into the cache slot.

Block ids are widened to int64 before they multiply the block stride (a big cache overflows
int32 offsets); padding tokens (slot -1) exit at once. An fp8 cache (``FP8``) gets
``x * (1 / scale)`` in fp32, saturated to +-448 and rounded to nearest even: the bytes
``kv_write_ref`` writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn (a constexpr: kernels read it)


@triton.jit
def to_cache(x, inv_scale, cache_ptr, FP8: tl.constexpr):
    """A tile of K or V in the cache's element type: quantized (``x * inv_scale``, saturated) for
    an fp8 cache, else x unchanged (it already is the cache dtype)."""
    if FP8:  # one return: the compiler types every return of a function alike
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX).to(
            cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return x


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    k_inv_scale,  # 1 / k_scale (fp8 caches only)
    v_inv_scale,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckb, stride_cks, stride_ckh, stride_ckd,
    stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE  # int64: slot_mapping is int64
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    k_dst = block_id * stride_ckb + offset * stride_cks + offs_h[:, None] * stride_ckh + offs_d[None, :] * stride_ckd
    v_dst = block_id * stride_cvb + offset * stride_cvs + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd
    tl.store(k_cache_ptr + k_dst, to_cache(k, k_inv_scale, k_cache_ptr, FP8), mask=mask)
    tl.store(v_cache_ptr + v_dst, to_cache(v, v_inv_scale, v_cache_ptr, FP8), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Launch the KV write (inputs already validated by ``kernels.checks``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale, num_kv_heads,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        FP8=key_cache.dtype == torch.float8_e4m3fn,
    )
