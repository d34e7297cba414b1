"""Split-K Triton paged attention for decode batches with few sequences and long contexts.

Design: with one query token per sequence the unified kernel launches only
``num_seqs * num_kv_heads`` programs, each walking the whole context — too few to fill a GPU when
the batch is small. Here the context is cut into partitions of ``PARTITION`` keys; program
(seq, kv head, partition) computes a partial softmax over its keys for all query heads of the
group (GQA packed, rows padded to 16 for ``tl.dot``) and writes the unnormalised output with its
running max and sum. A second kernel merges the partitions per (seq, head). The partition count
comes from the block-table width, so launching never syncs with the device; partitions past a
sequence's end write an empty result (max = -inf, sum = 0) that the merge ignores. In a
sliding-window layer the partitions start at the window's first key, so a long context needs only
``window / PARTITION`` of them and nothing before the window is read; attention sinks join the
softmax denominator in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_tile_triton import attend_decode, group_rows, head_pad
from kernels.checks import PagedAttentionSizes, paged_attention_sizes

PARTITION = 512  # keys per partition; a multiple of every BLOCK_N used below
_MIN_PROGRAMS = 256  # below this many (seq, kv head) programs the unified kernel leaves SMs idle
# The window the kernels get for full attention: wider than any context, so every edge is key 0
# (one code path, no branch; well inside int32 arithmetic next to positions < 2**30).
NO_WINDOW = 1 << 30


def kernel_window(sliding_window: int) -> int:
    """The kernels' ``window`` argument: the layer's sliding window, or NO_WINDOW for 0 (none)."""
    return sliding_window if sliding_window > 0 else NO_WINDOW


def window_context(sizes: PagedAttentionSizes, sliding_window: int) -> int:
    """The most keys one query of the call can see: the block table's capacity, or the window."""
    return min(sizes.max_context, sliding_window) if sliding_window > 0 else sizes.max_context


def fp8_scales(key_cache: torch.Tensor, scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(softmax scale, output scale) for the kernels: an fp8 cache holds ``K / k_scale`` and
    ``V / v_scale``, so ``k_scale`` folds into the softmax scale and ``v_scale`` multiplies the
    normalised output; float caches get ``(scale, 1.0)``."""
    if key_cache.dtype == torch.float8_e4m3fn:
        return scale * k_scale, v_scale
    return scale, 1.0


def use_split_k(num_seqs: int, num_kv_heads: int, max_context: int) -> bool:
    """Heuristic: split when the batch is small and the context spans several partitions."""
    return num_seqs * num_kv_heads < _MIN_PROGRAMS and max_context >= 2 * PARTITION


# Integers that change with the batch (the block-table width and the partitions it spans) stay out
# of Triton's specialisation key, as in the unified kernel.
@triton.jit(do_not_specialize=["num_parts", "stride_bt", "window"])
def _split_k_partial_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_parts, HEAD_PAD] fp32
    part_max_ptr,  # [num_seqs, num_heads, num_parts] fp32, log2 units
    part_sum_ptr,  # [num_seqs, num_heads, num_parts] fp32
    q_ptr,  # [num_tokens == num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,
    window,  # a query sees its last `window` keys; full attention: NO_WINDOW
    num_heads,
    num_parts,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    p_start = tl.maximum(seq_len - window, 0) + part * PARTITION_SIZE  # from the window's first key
    p_end = tl.minimum(p_start + PARTITION_SIZE, seq_len)  # the decode token sees every key after it
    block_row_ptr = block_tables_ptr + seq * stride_bt
    acc, m_i, l_i = attend_decode(q_ptr, token, kv_head, p_start, p_end, scale, block_row_ptr, k_cache_ptr, v_cache_ptr,
                                  stride_qt, stride_qh, stride_qd,
                                  stride_kb, stride_ks, stride_kh, stride_kd,
                                  stride_vb, stride_vs, stride_vh, stride_vd,
                                  HEAD_DIM, HEAD_PAD, GROUP, ROWS, BLOCK_N, BLOCK_SIZE, IEEE_FP32)

    head, row_ok = group_rows(kv_head, GROUP, ROWS)
    offs_d = tl.arange(0, HEAD_PAD)
    # Partial results are laid out contiguously: [num_seqs, num_heads, num_parts(, HEAD_PAD)].
    ml_off = (seq * num_heads + head).to(tl.int64) * num_parts + part  # [ROWS]
    tl.store(part_max_ptr + ml_off, m_i, mask=row_ok)
    tl.store(part_sum_ptr + ml_off, l_i, mask=row_ok)
    tl.store(part_out_ptr + ml_off[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_parts"])
def _split_k_reduce_kernel(
    out_ptr,  # [num_tokens == num_seqs, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_parts, HEAD_PAD] fp32
    part_max_ptr,  # [num_seqs, num_heads, num_parts] fp32
    part_sum_ptr,  # [num_seqs, num_heads, num_parts] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] fp32 sink logits (HAS_SINKS; else any pointer, never read)
    v_scale,  # 1.0, or an fp8 cache's v_scale
    num_heads,
    num_parts,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, PARTS_PAD)
    p_ok = offs_p < num_parts
    base = (seq * num_heads + head).to(tl.int64) * num_parts
    m = tl.load(part_max_ptr + base + offs_p, mask=p_ok, other=float("-inf"))  # [PARTS_PAD]
    l = tl.load(part_sum_ptr + base + offs_p, mask=p_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:  # the sink is one more term of the denominator (log2 units, like the maxima)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty partitions weigh nothing
    offs_d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_out_ptr + (base + offs_p)[:, None] * HEAD_PAD + offs_d[None, :],
                  mask=p_ok[:, None], other=0.0)  # [PARTS_PAD, HEAD_PAD]
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_all)
    out = num / tl.where(den == 0.0, 1.0, den) * v_scale  # v_scale: 1.0 unless fp8
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    o_off = token * stride_ot + head.to(tl.int64) * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def launch_split_k(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    partition: int = PARTITION,
    block_n: int = 32,
    sizes: PagedAttentionSizes | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-only split-K attention: requires exactly one query token per sequence. ``k_scale``/
    ``v_scale``: an fp8 cache's scales (``fp8_scales``); ``sliding_window`` (0 = none) and
    ``sinks`` as in ``launch_unified``."""
    if sizes is None:
        sizes = paged_attention_sizes(q, key_cache, block_tables)
    num_seqs, num_heads = sizes.num_seqs, sizes.num_heads
    if sizes.num_tokens != num_seqs:
        raise ValueError(f"split-K decode needs one query token per sequence: "
                         f"{sizes.num_tokens} tokens, {num_seqs} seqs")
    if block_n < 16 or block_n & (block_n - 1) or partition % block_n:
        raise ValueError(f"block_n ({block_n}) must be a power of two >= 16 dividing partition ({partition})")
    hpad = head_pad(sizes.head_dim)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    num_parts = triton.cdiv(window_context(sizes, sliding_window), partition)
    scale, v_scale = fp8_scales(key_cache, scale, k_scale, v_scale)
    f32 = dict(dtype=torch.float32, device=q.device)
    part_out = torch.empty((num_seqs, num_heads, num_parts, hpad), **f32)
    part_max = torch.empty((num_seqs, num_heads, num_parts), **f32)
    part_sum = torch.empty((num_seqs, num_heads, num_parts), **f32)
    _split_k_partial_kernel[(num_seqs, sizes.num_kv_heads, num_parts)](
        part_out, part_max, part_sum, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, kernel_window(sliding_window), num_heads, num_parts,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        HEAD_DIM=sizes.head_dim, HEAD_PAD=hpad, GROUP=sizes.group, ROWS=max(16, triton.next_power_of_2(sizes.group)),
        BLOCK_N=block_n, BLOCK_SIZE=sizes.block_size, PARTITION_SIZE=partition,
        IEEE_FP32=q.dtype == torch.float32,
    )
    _split_k_reduce_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, query_start_loc, query_start_loc if sinks is None else sinks, v_scale,
        num_heads, num_parts, *out.stride(),
        HEAD_DIM=sizes.head_dim, HEAD_PAD=hpad, PARTS_PAD=max(2, triton.next_power_of_2(num_parts)),
        HAS_SINKS=sinks is not None,
    )
    return out
