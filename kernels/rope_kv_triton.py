"""Triton RoPE + KV cache write in one launch: one program per token rotates its q and k heads and
writes the rotated k and its v into the token's cache slot.

Unfused, the rotated keys go out to memory, come back in the KV-write kernel and go out again
into the cache (two launches per layer). Here they are stored once to the returned ``k`` and once
to the cache from the same registers, rounded once to the cache dtype, so the cache holds exactly
what ``write_kv(apply_rope(q, k)[1], v)`` would write. The rotation is ``rope_triton.rotate_heads``
(the same code as ``apply_rope``); partial rotary copies the tail dims in the kernel, so the
tail reaches the cache too. Block ids are int64 (``slot_mapping`` is int64) before they meet a
stride; padding tokens (slot -1) are rotated but not written. An fp8 cache gets the rotated k (as
rounded to k's dtype) and v quantized by ``kv_write_triton.to_cache``, the KV write's own code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_write_triton import to_cache, write_kv_triton
from kernels.rope_triton import apply_rope_triton, load_cos_sin, rotate_heads, unit_last


@triton.jit
def _rope_kv_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim], unit stride on head_dim
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    q_ptr,  # [num_tokens, num_heads, head_dim], unit stride on head_dim
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    v_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, rotary_dim] = cat(cos, sin), unit stride on rotary_dim
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], unit stride on head_dim
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], unit stride on head_dim
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    k_inv_scale,  # 1 / k_scale (fp8 caches only)
    v_inv_scale,
    num_heads,
    num_kv_heads,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs,
    stride_ckb, stride_cks, stride_ckh,
    stride_cvb, stride_cvs, stride_cvh,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,
    TAIL: tl.constexpr,  # head_dim - rotary_dim: dims that pass through unrotated
    TAIL_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_x = tl.arange(0, HALF_PAD)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cs, offs_x, HALF)

    # q: rotate every head; the tail (partial rotary) is copied below.
    rotate_heads(q_out_ptr, q_ptr, token, num_heads, stride_qot, stride_qoh, stride_qt, stride_qh,
                 cos, sin, offs_x, HALF, Q_HEADS_PAD)

    # Where this token's k and v go in the cache (padding tokens, slot -1, write nothing there).
    slot = tl.load(slot_mapping_ptr + token)
    block_id = slot // BLOCK_SIZE  # int64
    in_block = slot % BLOCK_SIZE
    offs_kh = tl.arange(0, K_HEADS_PAD)
    kh_ok = offs_kh < num_kv_heads
    k_row = k_cache_ptr + block_id * stride_ckb + in_block * stride_cks + offs_kh[:, None] * stride_ckh
    v_row = v_cache_ptr + block_id * stride_cvb + in_block * stride_cvs + offs_kh[:, None] * stride_cvh

    # k: rotate, round once to the cache dtype, store to the returned k (in rotate_heads) and to the cache.
    k1, k2, k_mask = rotate_heads(k_out_ptr, k_ptr, token, num_kv_heads, stride_kot, stride_koh, stride_kt,
                                  stride_kh, cos, sin, offs_x, HALF, K_HEADS_PAD)
    if slot >= 0:
        tl.store(k_row + offs_x[None, :], to_cache(k1, k_inv_scale, k_cache_ptr, FP8), mask=k_mask)
        tl.store(k_row + HALF + offs_x[None, :], to_cache(k2, k_inv_scale, k_cache_ptr, FP8), mask=k_mask)

    if TAIL > 0:  # partial rotary: dims [2 * HALF, HEAD_DIM) pass through to q, k and the cache
        offs_t = 2 * HALF + tl.arange(0, TAIL_PAD)
        t_ok = offs_t < HEAD_DIM
        offs_qh = tl.arange(0, Q_HEADS_PAD)
        qt_mask = (offs_qh < num_heads)[:, None] & t_ok[None, :]
        q_tail = tl.load(q_ptr + token * stride_qt + offs_qh[:, None] * stride_qh + offs_t[None, :], mask=qt_mask)
        tl.store(q_out_ptr + token * stride_qot + offs_qh[:, None] * stride_qoh + offs_t[None, :], q_tail,
                 mask=qt_mask)
        kt_mask = kh_ok[:, None] & t_ok[None, :]
        k_tail = tl.load(k_ptr + token * stride_kt + offs_kh[:, None] * stride_kh + offs_t[None, :], mask=kt_mask)
        tl.store(k_out_ptr + token * stride_kot + offs_kh[:, None] * stride_koh + offs_t[None, :], k_tail,
                 mask=kt_mask)
        if slot >= 0:
            tl.store(k_row + offs_t[None, :], to_cache(k_tail, k_inv_scale, k_cache_ptr, FP8), mask=kt_mask)

    # v: copied into the cache as is.
    if slot >= 0:
        offs_d = tl.arange(0, HEAD_PAD)
        v_mask = kh_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptr + token * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :], mask=v_mask)
        tl.store(v_row + offs_d[None, :], to_cache(v, v_inv_scale, v_cache_ptr, FP8), mask=v_mask)


def rope_and_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, write rotated k and v into the caches; return the rotated (q, k)
    (inputs already validated by ``kernels.checks``)."""
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:  # caches are written in place: no copies
        q_rot, k_rot = apply_rope_triton(q, k, positions, cos_sin_cache)
        write_kv_triton(k_rot, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return q_rot, k_rot
    q, k, v, cos_sin_cache = unit_last(q), unit_last(k), unit_last(v), unit_last(cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    rotary_dim = cos_sin_cache.shape[1]
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    _rope_kv_kernel[(num_tokens,)](
        q_out, k_out, q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
        1.0 / k_scale, 1.0 / v_scale, num_heads, num_kv_heads,
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), TAIL=tail, TAIL_PAD=triton.next_power_of_2(max(tail, 1)),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1], FP8=key_cache.dtype == torch.float8_e4m3fn,
    )
    return q_out, k_out
