"""Unified Triton paged attention: prefill chunks and decode tokens in one launch.

Design: a query tile holds ``BLOCK_Q`` consecutive query tokens of one sequence times the
``GROUP`` query heads that share one kv head (GQA packing), so each K/V tile is loaded once for
the whole group: rows = tokens x heads-in-group. One program per (query tile, kv head). Keys are
walked in tiles of ``BLOCK_N`` positions, independent of the cache block size: every key
position finds its block through the block table, so a tile may span several blocks or part of
one. Softmax is online in fp32. Key tiles that every row of the program may see (before the
causal diagonal) skip all masking; only the last few tiles pay for it. A sliding-window layer
(``window`` > 0: a query at position p sees keys [p - window + 1, p], as transformers masks)
starts each program at the tile holding its first row's window edge, so the tiles before it are
never loaded (their blocks may already be freed), and masks the few tiles its rows' edges cross.
Attention sinks (``HAS_SINKS``) add one learned logit per head to the softmax denominator. Every ``tl.dot`` has
M, N, K >= 16 (head_dim and the group are padded and masked), so kernels that pass in the
interpreter also compile for a GPU. Block ids are widened to int64 before they meet a stride:
``block_id * block_stride`` overflows int32 on large caches.

Mixed batches (``SPLIT_DECODES``): prefill tiles want many rows (a K/V tile reused by 128 query
rows halves the K/V re-reads of 64-row tiles and feeds the tensor cores), but a decode sequence
has one token, so in such a tile 1 x GROUP rows are real and the rest pad: a 64-row tile did 16x
the MMA work of a decode and streamed its context at compute speed. With ``SPLIT_DECODES`` the
grid starts with one decode program per (sequence, kv head) of ``DECODE_ROWS`` = GROUP padded to
16 rows that exits unless the sequence has exactly one query token, followed by the query tiles,
which exit for single-token sequences. Both kinds write disjoint rows of one output in one
launch, so the memory-bound decode streams overlap the compute-bound prefill tiles on the SMs.

The grid needs no host sync: sequence i owns query tiles starting at
``query_start_loc[i] // BLOCK_Q + i`` (an upper bound on the tiles before it), which the kernel
inverts by binary search; programs past a sequence's last tile exit at once. Which programs
work is read on the device (query lengths), so the grid depends on shapes alone (CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_splitk_triton import fp8_scales, kernel_window, launch_split_k, use_split_k, window_context
from kernels.attention_tile_triton import attend_decode, attend_range, fold_sinks, group_rows, head_pad
from kernels.checks import PagedAttentionSizes, paged_attention_sizes

@triton.jit
def _find_seq(query_start_loc_ptr, last_seq, tile_id, BLOCK_Q: tl.constexpr):
    """Largest sequence i <= last_seq with query_start_loc[i] // BLOCK_Q + i <= tile_id."""
    # Plain assignments turn ints and constexprs (Triton specialises an argument equal to 1)
    # into i32 tensors, which the while loop needs for its loop-carried values.
    lo = 0
    hi = last_seq
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _query_tile(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    tile_id, kv_head, scale, v_scale, window, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE_FP32: tl.constexpr,
    HAS_SINKS: tl.constexpr, SKIP_DECODES: tl.constexpr,
):
    """One (query tile, kv head): BLOCK_Q tokens x GROUP_PAD heads of one sequence."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq = _find_seq(query_start_loc_ptr, num_seqs - 1, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    q_first = q_tile * BLOCK_Q
    work = q_first < query_len
    if SKIP_DECODES:  # single-token sequences have their own decode programs
        work = work & (query_len > 1)
    if work:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len

        offs_m = tl.arange(0, BLOCK_M)
        q_pos = q_first + offs_m // GROUP_PAD  # [BLOCK_M] position within this chunk
        head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] query head
        row_ok = (q_pos < query_len) & (offs_m % GROUP_PAD < GROUP)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_DIM

        token = (q_start + q_pos).to(tl.int64)
        q_off = token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        qk_scale = scale * 1.4426950408889634  # fold log2(e) in: exp2 is cheaper than exp

        # Keys [head_end, n_full) are visible to every row of the tile (k <= context_len + q_first,
        # and past every row's window edge): no masks there. The rest, from the tile of the first
        # row's window edge and up to the causal limit of the last valid row, is masked.
        last_q = tl.minimum(query_len, q_first + BLOCK_Q) - 1
        kv_end = context_len + last_q + 1
        n_full = (context_len + q_first + 1) // BLOCK_N * BLOCK_N
        row_end = (context_len + q_pos + 1)[:, None]  # [BLOCK_M, 1] causal: a row sees keys up to its own
        # A row sees its last `window` keys (full attention: a window past any context, so the
        # edges below are 0 and the head is empty). Tiles before the first row's edge are skipped.
        row_begin = row_end - window
        lo = tl.maximum(context_len + q_first + 1 - window, 0)
        hi = tl.maximum(kv_end - window, 0)  # the last valid row's edge
        start = lo // BLOCK_N * BLOCK_N
        head_end = tl.maximum(tl.minimum((hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N, n_full), start)
        block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        acc, m_i, l_i = attend_range(acc, m_i, l_i, q, row_ok, row_begin, row_end, lo, start, head_end, n_full, kv_end,
                                     qk_scale, block_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_ok,
                                     stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd,
                                     BLOCK_N, BLOCK_SIZE, IEEE_FP32)
        if HAS_SINKS:
            acc, l_i = fold_sinks(acc, m_i, l_i, sinks_ptr, head, row_ok)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # v_scale: 1.0 unless fp8
        o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_row(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    seq, kv_head, scale, v_scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE_FP32: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One (sequence, kv head) of a single-token sequence: its GROUP heads (padded to ROWS >= 16
    for tl.dot) over the whole context (its last ``window`` keys in a sliding-window layer);
    other sequences leave at once."""
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_len == 1:
        seq_len = tl.load(seq_lens_ptr + seq)
        token = q_start.to(tl.int64)
        block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        first = tl.maximum(seq_len - window, 0)  # the window's first key (0 for full attention)
        acc, m_i, l_i = attend_decode(q_ptr, token, kv_head, first, seq_len, scale, block_row_ptr, k_cache_ptr,
                                      v_cache_ptr,
                                      stride_qt, stride_qh, stride_qd,
                                      stride_kb, stride_ks, stride_kh, stride_kd,
                                      stride_vb, stride_vs, stride_vh, stride_vd,
                                      HEAD_DIM, HEAD_PAD, GROUP, ROWS, BLOCK_N, BLOCK_SIZE, IEEE_FP32)

        head, row_ok = group_rows(kv_head, GROUP, ROWS)
        if HAS_SINKS:
            acc, l_i = fold_sinks(acc, m_i, l_i, sinks_ptr, head, row_ok)
        offs_d = tl.arange(0, HEAD_PAD)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # v_scale: 1.0 unless fp8
        o_off = token * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


# Integers that change with the batch (and the sliding window, which differs between layers) stay out
# of Triton's specialisation key (which would compile
# a variant for every value that is 1 or a multiple of 16: seconds each, in the middle of serving).
@triton.jit(do_not_specialize=["num_seqs", "num_tiles", "stride_bt", "window"])
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] fp32 sink logits (HAS_SINKS; else any pointer, never read)
    scale,  # softmax scale (times k_scale for an fp8 cache)
    v_scale,  # 1.0, or an fp8 cache's v_scale
    window,  # a query sees its last `window` keys (itself included); full attention: NO_WINDOW
    num_seqs,
    num_tiles,  # query tiles in the grid: num_tokens // BLOCK_Q + num_seqs
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT_DECODES: tl.constexpr,  # programs [0, num_seqs) are decode programs, the rest query tiles
    DECODE_ROWS: tl.constexpr,  # rows of a decode program: GROUP padded to a power of two >= 16
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Query tiles run last tile first: blocks are dispatched in program order, and a chunk's later
    # tiles see the most keys, so the longest work starts first instead of trailing at the end.
    if SPLIT_DECODES:
        if pid < num_seqs:
            _decode_row(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                        query_start_loc_ptr, sinks_ptr, pid, kv_head, scale, v_scale, window,
                        stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                        stride_bt, HEAD_DIM, HEAD_PAD, GROUP, DECODE_ROWS, BLOCK_N, BLOCK_SIZE, IEEE_FP32,
                        HAS_SINKS)
        else:
            _query_tile(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                        query_start_loc_ptr, sinks_ptr, num_tiles - 1 - (pid - num_seqs), kv_head, scale, v_scale,
                        window, num_seqs,
                        stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                        stride_bt, HEAD_DIM, HEAD_PAD, GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, BLOCK_SIZE, IEEE_FP32,
                        HAS_SINKS, SKIP_DECODES=True)
    else:
        _query_tile(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, sinks_ptr, num_tiles - 1 - pid, kv_head, scale, v_scale, window, num_seqs,
                    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                    stride_bt, HEAD_DIM, HEAD_PAD, GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, BLOCK_SIZE, IEEE_FP32,
                    HAS_SINKS, SKIP_DECODES=False)


def _check_tile(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def launch_unified(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    block_m: int | None = None,
    split_decodes: bool | None = None,
    sizes: PagedAttentionSizes | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the unified kernel (inputs already validated by ``kernels.checks``, whose result
    ``sizes`` is; computed here when None). Every choice below reads shapes only.

    ``block_n``: key-tile width (default 64 on a GPU, 32 in the interpreter). ``block_m``: target
    rows per query tile, tokens x heads-in-group (default 16; on a GPU 128 when the batch holds
    prefill tokens, run by 8 warps: each K/V tile then serves 128 query rows). ``split_decodes``:
    give single-token sequences their own decode programs (default: when the batch holds prefill
    tokens, i.e. ``num_tokens > num_seqs``; a decode-only batch is all decode programs anyway).
    ``k_scale``/``v_scale``: an fp8 cache's scales (``fp8_scales``; float caches ignore them).
    ``sliding_window``: keys a query sees (its own included), 0 = all; ``sinks``: ``[num_heads]``
    fp32 sink logits, or None.
    """
    if sizes is None:
        sizes = paged_attention_sizes(q, key_cache, block_tables)
    num_tokens, num_seqs = sizes.num_tokens, sizes.num_seqs
    has_prefill = num_tokens > num_seqs
    if block_n is None:
        block_n = 64 if q.is_cuda else 32
    if block_m is None:
        block_m = 128 if q.is_cuda and has_prefill else 16
    if split_decodes is None:
        split_decodes = has_prefill
    _check_tile("block_n", block_n)
    _check_tile("block_m", block_m)
    group_pad = triton.next_power_of_2(sizes.group)
    # Rows = BLOCK_Q tokens x GROUP_PAD heads, at least 16 (tl.dot needs M >= 16).
    block_q = max(1, block_m // group_pad)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_tiles = num_tokens // block_q + num_seqs
    num_programs = num_tiles + (num_seqs if split_decodes else 0)
    scale, v_scale = fp8_scales(key_cache, scale, k_scale, v_scale)
    _unified_attention_kernel[(num_programs, sizes.num_kv_heads)](
        out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seq_lens if sinks is None else sinks,
        scale, v_scale, kernel_window(sliding_window), num_seqs, num_tiles,
        *q.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        HEAD_DIM=sizes.head_dim, HEAD_PAD=head_pad(sizes.head_dim), GROUP=sizes.group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=sizes.block_size,
        IEEE_FP32=q.dtype == torch.float32, HAS_SINKS=sinks is not None, SPLIT_DECODES=split_decodes,
        DECODE_ROWS=max(16, group_pad),
        num_warps=8 if block_q * group_pad >= 128 else 4,
    )
    return out


def paged_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sizes: PagedAttentionSizes | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick split-K for decode-only batches that cannot fill the GPU, else the unified kernel.

    Decode-only is read from shapes (one query token per sequence), the context bound from the
    block table width and the window, so the choice never syncs with the device.
    """
    if sizes is None:
        sizes = paged_attention_sizes(q, key_cache, block_tables)
    decode_only = sizes.num_tokens == sizes.num_seqs
    if decode_only and use_split_k(sizes.num_seqs, sizes.num_kv_heads, window_context(sizes, sliding_window)):
        return launch_split_k(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              sizes=sizes, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                              sinks=sinks)
    return launch_unified(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sizes=sizes,
                          k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, sinks=sinks)
