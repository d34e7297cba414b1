"""Online-softmax attention over paged keys, shared by the unified and split-K kernels.

Design: ``attend_range`` walks a range of key tiles for the unified kernel's query tiles and
decode programs and for split-K's partitions, which differ only in the range and in each row's
last visible key (causal for prefill rows, the range end for decode rows). It says with
``MASKED=False`` that a whole tile holds keys every row may see (the tiles before the causal
diagonal and the range end: most of them), which skips the masks and the ``where``, and masks
only the tail, plus, for a sliding-window layer, the head: the tiles where the window's lower
edge (one per row) falls. Tiles wholly before every row's window are never visited. ``attend_tile`` is one step: it finds each key's cache block through the block
table, scores the tile with ``tl.dot``, folds it into the running max and sum in fp32 (log2
units: ``qk_scale`` already holds log2(e)) and accumulates ``P @ V``. Block ids are widened to
int64 before they meet a stride, so offsets into a large cache cannot overflow int32. Both dots
have K >= 16 as long as the caller pads ``HEAD_PAD`` and ``BLOCK_N`` to at least 16
(``head_pad`` below), which the GPU compiler requires. An fp8 cache's tiles are upcast to q's
dtype as they load (the dots run in q's dtype); its per-tensor scales never reach this loop: the
launchers fold ``k_scale`` into the softmax scale and ``v_scale`` into the output. Attention
sinks (gpt-oss: one learned logit per head in the softmax denominator, no value) are folded in
once, after the walk (``fold_sinks``), like one more key whose value is zero.
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
    k = k.to(q.dtype)  # fp8 cache: dequantize (the scale is in qk_scale); else a no-op
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
    v = v.to(q.dtype)  # fp8 cache: dequantize (v_scale multiplies the output); else a no-op
    if IEEE_FP32:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def attend_range(
    acc,  # [ROWS, HEAD_PAD] fp32, unnormalised output so far
    m_i,  # [ROWS] fp32, running max of the scaled scores (log2 units)
    l_i,  # [ROWS] fp32, running sum of exp2(score - m_i)
    q,  # [ROWS, HEAD_PAD], zero in padded rows and dims
    row_ok,  # [ROWS] rows that hold a query (the others are padding and see no key)
    row_begin,  # [ROWS, 1] or scalar: the first key position each row may see (its window's edge)
    row_end,  # [ROWS, 1] or scalar: one past the last key position each row may see
    lo,  # the smallest row_begin: keys before it are never loaded (their blocks may be freed)
    start,  # first key position of the range: lo, or lo rounded down to a tile
    head_end,  # keys [start, head_end) are masked (window edges); start + a multiple of BLOCK_N
    n_full,  # keys [head_end, n_full) are visible to every row; head_end + a multiple of BLOCK_N
    end,  # one past the last key of the range: row_end <= end
    qk_scale,  # softmax scale * log2(e)
    block_row_ptr,  # this sequence's row of the block table, int32 block ids
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_head,
    offs_d,  # [HEAD_PAD] arange
    d_ok,  # [HEAD_PAD] offs_d < head_dim
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Fold keys [start, end) into ``(acc, m_i, l_i)`` and return the updated triple.

    Design: the whole tiles of [head_end, n_full) run ``attend_tile`` with ``MASKED=False`` (no
    masks, no ``where``: most of a long context); the rest, [start, head_end) and [n_full, end),
    is masked per (row, key) by ``row_begin <= k_pos < row_end``. That one rule covers every
    caller: a prefill row sees keys up to its own position, ``row_end = context_len + q_pos + 1``,
    and from ``row_end - window`` on in a sliding-window layer (else ``row_begin = 0`` and the
    head is empty); a decode row sees every key of its range, so it passes the scalars ``start``
    and ``end`` (the test is then ``k_ok`` itself, which the compiler reuses). ``row_ok`` stays a
    separate factor of the mask: with a constant ``GROUP`` the compiler then drops the padded
    rows' softmax in the masked tile."""
    for n_start in range(head_end, n_full, BLOCK_N):
        k_pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_pos, k_pos, k_pos, qk_scale, block_row_ptr,
                                    k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_ok,
                                    stride_kb, stride_ks, stride_kh, stride_kd,
                                    stride_vb, stride_vs, stride_vh, stride_vd,
                                    BLOCK_SIZE, IEEE_FP32, MASKED=False)
    # One masked loop over the head's tiles, then the tail's (the online softmax is order-free).
    num_head = (head_end - start) // BLOCK_N
    for i in range(0, num_head + (end - n_full + BLOCK_N - 1) // BLOCK_N):
        n_start = tl.where(i < num_head, start + i * BLOCK_N, n_full + (i - num_head) * BLOCK_N)
        k_pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = (k_pos >= lo) & (k_pos < end)
        # [ROWS, BLOCK_N]; implies k_ok
        visible = (k_pos[None, :] >= row_begin) & (k_pos[None, :] < row_end) & row_ok[:, None]
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_pos, k_ok, visible, qk_scale, block_row_ptr,
                                    k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_ok,
                                    stride_kb, stride_ks, stride_kh, stride_kd,
                                    stride_vb, stride_vs, stride_vh, stride_vd,
                                    BLOCK_SIZE, IEEE_FP32, MASKED=True)
    return acc, m_i, l_i


@triton.jit
def group_rows(kv_head, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """The ``GROUP`` query heads that share ``kv_head`` (GQA) as ``ROWS`` rows: returns each row's
    head and whether it holds one (rows r >= GROUP pad the group to ROWS >= 16 for ``tl.dot``)."""
    offs_r = tl.arange(0, ROWS)
    return kv_head * GROUP + offs_r, offs_r < GROUP  # [ROWS], [ROWS]


@triton.jit
def attend_decode(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    token,  # int64 row of q: the decode token
    kv_head,
    start,  # keys [start, end) of the token's sequence
    end,
    scale,
    block_row_ptr,  # this sequence's row of the block table, int32 block ids
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """One decode token's ``GROUP`` query heads of ``kv_head`` over keys [start, end); returns the
    unnormalised ``(acc, m_i, l_i)``, rows as in ``group_rows`` (padded rows hold nothing to store).

    Shared by the unified kernel's decode programs (the whole context, or its window) and split-K's
    partitions: the token sees every key of the range, so only its last, partial tile is masked. An empty range
    (a partition past the sequence end) returns the empty state: max -inf, sum 0."""
    head, row_ok = group_rows(kv_head, GROUP, ROWS)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_off = token * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, HEAD_PAD]

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # fold log2(e) in: exp2 is cheaper than exp
    n_full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # an empty range has no whole tile
    return attend_range(acc, m_i, l_i, q, row_ok, start, end, start, start, start, n_full, end, qk_scale,
                        block_row_ptr,
                        k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_ok,
                        stride_kb, stride_ks, stride_kh, stride_kd,
                        stride_vb, stride_vs, stride_vh, stride_vd,
                        BLOCK_N, BLOCK_SIZE, IEEE_FP32)


@triton.jit
def fold_sinks(
    acc,  # [ROWS, HEAD_PAD] fp32, unnormalised output
    m_i,  # [ROWS] fp32, running max (log2 units)
    l_i,  # [ROWS] fp32, running sum
    sinks_ptr,  # [num_heads] the learned sink logits (natural-log units, unscaled)
    head,  # [ROWS] each row's query head
    row_ok,  # [ROWS] rows that hold a query
):
    """Add each row's sink to the softmax denominator: ``l += exp(sink)`` at the running max, as
    transformers' gpt-oss concatenates the sink to the scores and drops its column after the
    softmax. Returns ``(acc, l_i)`` rescaled to the new max (the output is ``acc / l_i``)."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows: nothing at all
    alpha = tl.exp2(m_i - m_safe)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_safe)
