"""One online-softmax step over a tile of paged keys, shared by the unified and split-K kernels.

Design: the caller owns the loop over key tiles and decides which (row, key) pairs may attend
(the unified kernel adds the causal limit, split-K only its partition bounds), or says with
``MASKED=False`` that the whole tile holds keys every row may see (the tiles before the causal
diagonal and the sequence end: most of them), which skips the masks and the ``where``; this step finds
each key's cache block through the block table, scores the tile with ``tl.dot``, folds it into
the running max and sum in fp32 (log2 units: ``qk_scale`` already holds log2(e)) and accumulates
``P @ V``. Block ids are widened to int64 before they meet a stride, so offsets into a large cache
cannot overflow int32. Both dots have K >= 16 as long as the caller pads ``HEAD_PAD`` and
``BLOCK_N`` to at least 16 (``head_pad`` below), which the GPU compiler requires.
"""

from __future__ import annotations

import triton
import triton.language as tl


def head_pad(head_dim: int) -> int:
    """head_dim rounded up to a power of two, at least 16 (the smallest legal tl.dot K)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def attend_tile(
    acc,  # [ROWS, HEAD_PAD] fp32, unnormalised output so far
    m_i,  # [ROWS] fp32, running max of the scaled scores (log2 units)
    l_i,  # [ROWS] fp32, running sum of exp2(score - m_i)
    q,  # [ROWS, HEAD_PAD], zero in padded rows and dims
    k_pos,  # [BLOCK_N] key positions of this tile within the sequence
    k_ok,  # [BLOCK_N] positions that hold a key (others are not loaded)
    visible,  # [ROWS, BLOCK_N] pairs that may attend; must imply k_ok
    qk_scale,  # softmax scale * log2(e)
    block_row_ptr,  # this sequence's row of the block table, int32 block ids
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_head,
    offs_d,  # [HEAD_PAD] arange
    d_ok,  # [HEAD_PAD] offs_d < head_dim
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """Fold one key tile into ``(acc, m_i, l_i)`` and return the updated triple.

    With ``MASKED=False`` every key of the tile exists and is visible to every row (``k_ok`` and
    ``visible`` are ignored): padded rows hold q = 0, so they score 0 and stay finite, and their
    output is never stored."""
    if MASKED:
        block_id = tl.load(block_row_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        block_id = tl.load(block_row_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
    in_block = (k_pos % BLOCK_SIZE).to(tl.int64)
    k_off = (block_id * stride_kb + in_block * stride_ks + kv_head * stride_kh)[None, :] \
        + offs_d[:, None] * stride_kd
    if MASKED:
        k = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, BLOCK_N]
    else:
        k = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None], other=0.0)
    if IEEE_FP32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if MASKED:
        s = tl.where(visible, s * qk_scale, float("-inf"))  # [ROWS, BLOCK_N], log2 units
    else:
        s = s * qk_scale

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    v_off = (block_id * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None] \
        + offs_d[None, :] * stride_vd
    if MASKED:
        v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
    else:
        v = tl.load(v_cache_ptr + v_off, mask=d_ok[None, :], other=0.0)
    if IEEE_FP32:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i
