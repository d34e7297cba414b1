"""Triton rotary embedding (neox / HF ``rotate_half``): one program per token, q and k heads together.

Each program loads the token's cos/sin row once and rotates every q and k head with it in fp32,
then casts back. With partial rotary the launcher copies the untouched tail dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cs, offs_x, HALF: tl.constexpr):
    """The token's cos and sin halves in fp32 (``[HALF_PAD]``, zero past ``HALF``); each row of
    the cache is ``cat(cos, sin)``."""
    pos = tl.load(positions_ptr + token)
    x_ok = offs_x < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_x, mask=x_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_x, mask=x_ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_heads(dst_ptr, src_ptr, token, num_heads, stride_dt, stride_dh, stride_st, stride_sh,
                 cos, sin, offs_x, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Rotate the first ``2 * HALF`` dims of one token's heads from src into dst; return the two
    stored halves (``[HEADS_PAD, HALF_PAD]`` in dst's dtype) and their mask.

    HF ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` on the two halves of x, in fp32.
    Shared with the fused RoPE + KV write kernel, which stores the returned k halves into the
    cache too: both compile the same arithmetic and agree bit for bit."""
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h < num_heads)[:, None] & (offs_x < HALF)[None, :]
    src = src_ptr + token * stride_st + offs_h[:, None] * stride_sh + offs_x[None, :]
    dst = dst_ptr + token * stride_dt + offs_h[:, None] * stride_dh + offs_x[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos[None, :] + (-x2) * sin[None, :]).to(dst_ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dst_ptr.dtype.element_ty)
    tl.store(dst, out1, mask=mask)
    tl.store(dst + HALF, out2, mask=mask)
    return out1, out2, mask


@triton.jit
def _rope_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim], unit stride on head_dim
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    q_ptr,  # [num_tokens, num_heads, head_dim], unit stride on head_dim
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, rotary_dim], unit stride on rotary_dim
    num_heads,
    num_kv_heads,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_cs,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_x = tl.arange(0, HALF_PAD)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cs, offs_x, HALF)
    rotate_heads(q_out_ptr, q_ptr, token, num_heads, stride_qot, stride_qoh, stride_qt, stride_qh,
                 cos, sin, offs_x, HALF, Q_HEADS_PAD)
    rotate_heads(k_out_ptr, k_ptr, token, num_kv_heads, stride_kot, stride_koh, stride_kt, stride_kh,
                 cos, sin, offs_x, HALF, K_HEADS_PAD)


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride on its last dim (the kernels' loads assume it); copies only if needed."""
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotated copies of q and k (inputs already validated by ``kernels.checks``)."""
    q, k, cos_sin_cache = unit_last(q), unit_last(k), unit_last(cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)
    if rotary_dim < q.shape[2]:  # partial rotary: tail dims pass through unchanged
        q_out[..., rotary_dim:] = q[..., rotary_dim:]
        k_out[..., rotary_dim:] = k[..., rotary_dim:]
    if q.shape[0] == 0:
        return q_out, k_out
    half = rotary_dim // 2
    _rope_kernel[(q.shape[0],)](
        q_out, k_out, q, k, positions, cos_sin_cache, q.shape[1], k.shape[1],
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
    )
    return q_out, k_out
