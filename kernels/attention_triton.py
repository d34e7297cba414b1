"""Unified Triton paged attention: prefill chunks and decode tokens in one launch.

Design: one program per (query tile, kv head). A query tile holds ``BLOCK_Q`` consecutive query
tokens of one sequence times the ``GROUP`` query heads that share the kv head (GQA packing), so
each K/V tile is loaded once for the whole group: rows = tokens x heads-in-group. Keys are walked
in tiles of ``BLOCK_N`` positions, independent of the cache block size: every key position finds
its block through the block table, so a tile may span several blocks or part of one. Softmax is
online in fp32. Every ``tl.dot`` has M, N, K >= 16 (head_dim and the group are padded and
masked), so kernels that pass in the interpreter also compile for a GPU. Block ids are widened to
int64 before they meet a stride: ``block_id * block_stride`` overflows int32 on large caches.

The grid needs no host sync: sequence i owns query tiles starting at
``query_start_loc[i] // BLOCK_Q + i`` (an upper bound on the tiles before it), which the kernel
inverts by binary search; programs past a sequence's last tile exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_splitk_triton import launch_split_k, use_split_k
from kernels.attention_tile_triton import attend_tile, head_pad
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
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,
    num_seqs,
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
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    seq = _find_seq(query_start_loc_ptr, num_seqs - 1, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    q_pos = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] position within this chunk
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

    # Keys this tile can see: up to the causal limit of its last valid query row.
    last_q = tl.minimum(query_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = context_len + last_q + 1
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n_start in range(0, kv_end, BLOCK_N):
        k_pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = k_pos < kv_end
        visible = (k_pos[None, :] <= context_len + q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_pos, k_ok, visible, qk_scale, block_row_ptr,
                                    k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_ok,
                                    stride_kb, stride_ks, stride_kh, stride_kd,
                                    stride_vb, stride_vs, stride_vh, stride_vd,
                                    BLOCK_SIZE, IEEE_FP32)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


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
    sizes: PagedAttentionSizes | None = None,
) -> torch.Tensor:
    """Run the unified kernel (inputs already validated by ``kernels.checks``, whose sizes
    ``sizes`` is; computed here when None).

    ``block_n`` is the key-tile width (default 64 on a GPU, 32 in the interpreter); ``block_m``
    the target rows per query tile (tokens x heads-in-group; default 16, or 64 on a GPU when the
    batch holds prefill tokens, so a K/V tile is reused by more query rows).
    """
    if sizes is None:
        sizes = paged_attention_sizes(q, key_cache, block_tables)
    num_tokens, num_seqs = sizes.num_tokens, sizes.num_seqs
    if block_n is None:
        block_n = 64 if q.is_cuda else 32
    if block_m is None:
        block_m = 64 if q.is_cuda and num_tokens > num_seqs else 16
    for name, value in (("block_n", block_n), ("block_m", block_m)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    group_pad = triton.next_power_of_2(sizes.group)
    # Rows = BLOCK_Q tokens x GROUP_PAD heads, at least 16 (tl.dot needs M >= 16).
    block_q = max(1, block_m // group_pad)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // block_q + num_seqs, sizes.num_kv_heads)
    _unified_attention_kernel[grid](
        out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, num_seqs,
        *q.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        HEAD_DIM=sizes.head_dim, HEAD_PAD=head_pad(sizes.head_dim), GROUP=sizes.group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=sizes.block_size,
        IEEE_FP32=q.dtype == torch.float32,
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
) -> torch.Tensor:
    """Pick split-K for decode-only batches that cannot fill the GPU, else the unified kernel.

    Decode-only is read from shapes (one query token per sequence), the context bound from the
    block table width, so the choice never syncs with the device.
    """
    if sizes is None:
        sizes = paged_attention_sizes(q, key_cache, block_tables)
    decode_only = sizes.num_tokens == sizes.num_seqs
    if decode_only and use_split_k(sizes.num_seqs, sizes.num_kv_heads, sizes.max_context):
        return launch_split_k(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              sizes=sizes)
    return launch_unified(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sizes=sizes)
