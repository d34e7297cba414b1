"""Pure-torch paged attention: the reference for the Triton kernels and the CPU runtime path.

Design: the math is fp32. K/V are gathered block-wise with one ``index_select`` on the block dim
of the (strided) per-layer cache view, into one dense buffer per call: every block is one
contiguous run of ``block_size * num_kv_heads * head_dim`` elements, so the gather is a series of
memcpys. Decode rows (query_len == 1) are padded to the longest context and done in batched SDPA
calls over chunks of sequences (``DECODE_CHUNK_BYTES`` of K/V each), gathered into one pair of
scratch buffers reused by every chunk: no fresh multi-MB allocation (and page faults) per chunk,
and the copy is still in cache when SDPA reads it. Decode is bound by memory traffic (the gather
runs at memcpy speed; SDPA beat explicit matmuls), so there is little else to win in pure torch.
No mask when all contexts are equal. Sequences
with several query tokens (prefill chunks) get one SDPA call each, causal (``is_causal``) when
the chunk has no earlier context and with a bottom-right mask otherwise. GQA never repeats K/V
per query head: decode packs the query heads of one KV group as extra query rows, prefill
broadcasts K/V over the group with a stride-0 ``expand``.

Sliding windows (a query at position p sees keys [p - window + 1, p], transformers' mask) gather
only the blocks a window can reach: a decode row the ``(window - 1) // block_size + 2`` blocks
from its window's first one, a prefill chunk the blocks from its first row's window edge on; the
blocks before may already be freed (the null block in the table), so they are never read. That
gather is where a window saves time on the CPU (bench/window_decode.py). Attention sinks
(gpt-oss: one learned logit per head in the softmax denominator) take the explicit math path:
SDPA has no such term.

Off the CPU this module is the oracle the Triton kernels are tested against, not a runtime path,
so there it does not call SDPA: CUDA's fused SDPA backends (memory-efficient attention for fp32
with a mask) take these stride-0 K/V and strided queries through layout-specific code paths with
a history of silent wrong results (PyTorch issues 191937, 187227), and the ``test_kernels_gpu``
failure at the last, lone row of a 129-token chunk over 3,000 cached tokens matched that pattern
while the kernel was exact at the same shape and tiles in Triton's interpreter. ``_attend`` does
the math explicitly in float64 there, in query chunks of bounded size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Decode K/V gathered per SDPA call, at most (about): small enough that a 256-sequence batch never
# materialises hundreds of MB per layer, big enough that one SDPA call serves a typical batch (1 MB
# split an 8 x 300 `small` step into 8 calls per layer and measured no faster).
DECODE_CHUNK_BYTES = 8 << 20
# Query chunks up to this long run as decode rows (one per token) beside the decodes: verification
# chunks of speculative decoding (1 + k tokens) in one batched pass, not one call per sequence.
SHORT_CHUNK = 16
# Off the CPU: float64 scores per explicit-math chunk of query rows, at most (about).
ORACLE_CHUNK_BYTES = 256 << 20


def _explicit_math(device: torch.device) -> bool:
    """Whether ``_attend`` does the math itself: everywhere but the CPU (tests patch this)."""
    return device.type != "cpu"


def _attend(
    q: torch.Tensor,  # [..., query_len, head_dim] fp32
    k: torch.Tensor,  # [..., seq_len, head_dim] fp32 (may be a stride-0 expand)
    v: torch.Tensor,  # [..., seq_len, head_dim] fp32
    scale: float,
    mask: torch.Tensor | None = None,  # bool, broadcastable to [..., query_len, seq_len]; True = attend
    is_causal: bool = False,  # square causal (top-left diagonal), only without a mask
    sinks: torch.Tensor | None = None,  # fp32, broadcastable to [..., query_len, 1]: sink logits
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on the CPU; elsewhere, or with sinks, the same math done
    explicitly (float64 off the CPU: the oracle for the Triton kernels, no fused-kernel layout
    paths, no TF32)."""
    explicit = _explicit_math(q.device)
    if not explicit and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    math_dtype = torch.float64 if explicit else torch.float32
    query_len, seq_len = q.shape[-2], k.shape[-2]
    if is_causal:
        mask = torch.ones((query_len, seq_len), dtype=torch.bool, device=q.device).tril()
    rows_per_chunk = max(1, ORACLE_CHUNK_BYTES // (8 * seq_len * max(1, q[..., 0, 0].numel())))
    k64, v64 = k.to(math_dtype), v.to(math_dtype)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a in range(0, query_len, rows_per_chunk):
        scores = torch.matmul(q[..., a: a + rows_per_chunk, :].to(math_dtype), k64.transpose(-1, -2)) * scale
        if mask is not None:
            rows_mask = mask if mask.shape[-2] == 1 else mask[..., a: a + rows_per_chunk, :]
            scores = scores.masked_fill(~rows_mask, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # transformers' gpt-oss: softmax over [scores, sink], the sink's column dropped
            sink = sinks.to(math_dtype)
            if sink.shape[-2] != 1:
                sink = sink[..., a: a + rows_per_chunk, :]
            peak = torch.maximum(scores.amax(-1, keepdim=True), sink)
            probs = (scores - peak).exp()
            probs = probs / (probs.sum(-1, keepdim=True) + (sink - peak).exp())
        out[..., a: a + rows_per_chunk, :] = torch.matmul(probs, v64)
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int,
            buf: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``table`` -> ``[n, num_kv_heads, length, head_dim]`` fp32 (a strided view of one copy).

    cache: [num_blocks, block_size, num_kv_heads, head_dim], any block stride;
    table: [n, n_blocks] int64 with ``n_blocks * block_size >= length``;
    buf: optional cache-dtype scratch of at least ``n * n_blocks`` blocks to gather into.
    """
    n, n_blocks = table.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    # [n * n_blocks, block_size, KVH, D], contiguous: upcast here (no-op for fp32), where the
    # conversion is one dense pass rather than a strided one.
    if buf is None:
        blocks = cache.index_select(0, table.reshape(-1)).float()
    else:
        blocks = torch.index_select(cache, 0, table.reshape(-1), out=buf[: n * n_blocks]).float()
    kv = blocks.view(n, n_blocks * block_size, num_kv_heads, head_dim)[:, :length]
    return kv.transpose(1, 2)


def _prefill_one(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,  # [n_blocks] int64: the sequence's blocks, in order
    seq_len: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:
    query_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    context_len = seq_len - query_len
    # A window reads from the block of the first row's first visible key on.
    first = max(0, context_len + 1 - window) // block_size * block_size if window else 0
    length = seq_len - first
    k = _gather(key_cache, blocks[None, first // block_size:], length)[0]  # [KVH, length, D]
    v = _gather(value_cache, blocks[None, first // block_size:], length)[0]
    # [KVH, group, query_len, D] queries over [KVH, group (stride 0), length, D] keys.
    qg = q.float().view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k = k[:, None].expand(num_kv_heads, group, length, head_dim)
    v = v[:, None].expand(num_kv_heads, group, length, head_dim)
    head_sinks = None if sinks is None else sinks.float().view(num_kv_heads, group, 1, 1)
    if context_len == 0 and not window:  # square causal: SDPA's top-left diagonal is the right one
        out = _attend(qg, k, v, scale, is_causal=True, sinks=head_sinks)
    else:  # query i sits at position context_len + i: bottom-right aligned mask
        q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [query_len, length]
        if window:
            mask &= k_pos > q_pos - window
        out = _attend(qg, k, v, scale, mask=mask, sinks=head_sinks)
    return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)


def _decode_batch(
    q: torch.Tensor,  # [n, num_heads, head_dim]: one query token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int32
    seq_lens: torch.Tensor,  # [n] int32, on q's device
    min_len: int,
    max_len: int,
    scale: float,
    k_buf: torch.Tensor | None = None,  # scratch for _gather, reused across chunks
    v_buf: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = _decode_span(max_len, block_size, window)
    arange = torch.arange(n_blocks, device=q.device)[None, :]
    mask = None
    if window:
        # Each row's blocks from its window's first one: [first, first + n_blocks) of its table.
        first = (seq_lens.long() - window).clamp_(min=0) // block_size  # [n]
        cols = first[:, None] + arange  # [n, n_blocks]
        table = block_tables.long().gather(1, cols.clamp(max=block_tables.shape[1] - 1))
        table = table.masked_fill(cols * block_size >= seq_lens[:, None], 0)  # past the end: masked
        k_pos = (first * block_size)[:, None] + torch.arange(n_blocks * block_size, device=q.device)[None, :]
        mask = ((k_pos < seq_lens[:, None]) & (k_pos >= seq_lens[:, None] - window))[:, None, None, :]
        length = n_blocks * block_size
    else:
        table = block_tables[:, :n_blocks].long()
        length = max_len
        if min_len != max_len:
            # Entries past a sequence's last block may hold anything: point them at block 0 (masked).
            table = table.masked_fill(arange * block_size >= seq_lens[:, None], 0)
            k_pos = torch.arange(max_len, device=q.device)
            mask = (k_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [n, 1, 1, max_len]
    k = _gather(key_cache, table, length, k_buf)  # [n, KVH, length, D]
    v = _gather(value_cache, table, length, v_buf)
    qg = q.float().view(n, num_kv_heads, group, head_dim)  # the group's heads as query rows
    head_sinks = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1)
    out = _attend(qg, k, v, scale, mask=mask, sinks=head_sinks)
    return out.reshape(n, num_heads, head_dim)


def _decode_span(max_len: int, block_size: int, window: int) -> int:
    """Blocks a decode row's keys can span: all of the longest context's, or at most those of a
    window (its ``window`` keys start anywhere in a block)."""
    n_blocks = -(-max_len // block_size)
    return min(n_blocks, (window - 1) // block_size + 2) if window else n_blocks


def _decode_chunked(q, key_cache, value_cache, block_tables, seq_lens, lens: list[int], scale: float,
                    window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows in chunks of sequences whose gathered K/V stay within ``DECODE_CHUNK_BYTES``."""
    n = q.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    max_len = max(lens)
    span = _decode_span(max_len, block_size, window)
    per_seq = 2 * span * block_size * num_kv_heads * head_dim * 4  # K + V fp32 bytes
    step = max(1, DECODE_CHUNK_BYTES // per_seq)
    if step >= n:
        return _decode_batch(q, key_cache, value_cache, block_tables, seq_lens, min(lens), max_len, scale,
                             window=window, sinks=sinks)
    # Blocks for the longest chunk; every chunk gathers into these, so they stay cache-resident.
    buf_blocks = step * span
    k_buf = key_cache.new_empty((buf_blocks, block_size, num_kv_heads, head_dim))
    v_buf = value_cache.new_empty((buf_blocks, block_size, num_kv_heads, head_dim))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a in range(0, n, step):
        chunk = lens[a: a + step]
        out[a: a + step] = _decode_batch(q[a: a + step], key_cache, value_cache, block_tables[a: a + step],
                                         seq_lens[a: a + step], min(chunk), max(chunk), scale, k_buf, v_buf,
                                         window, sinks)
    return out


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Paged causal attention in fp32 torch: ``[num_tokens, num_heads, head_dim]`` in ``out_dtype``
    (default q's dtype; tests ask for fp32 to compare half-precision kernels without rounding).

    ``sliding_window`` > 0: a query at position p sees keys [p - window + 1, p] only, and table
    entries before the window are never read. ``sinks``: one logit per head added to the softmax
    denominator (gpt-oss).

    An fp8 cache holds ``K / k_scale`` and ``V / v_scale``: the gather upcasts it to fp32 like any
    cache, ``k_scale`` folds into the softmax scale (``q . (k * s) = (q . k) * s``) and ``v_scale``
    multiplies the output (softmax weights sum to 1), as the Triton kernels do. Float caches
    ignore the scales."""
    out_dtype = out_dtype or q.dtype
    if key_cache.dtype is not torch.float8_e4m3fn:
        return _paged_attention_fp32(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     scale, sliding_window, sinks).to(out_dtype)
    out = _paged_attention_fp32(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale * k_scale,
                                sliding_window, sinks)
    return out.mul_(v_scale).to(out_dtype)


def _paged_attention_fp32(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                          scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """``paged_attention_ref``'s math, in fp32 (a cache's stored values, whatever their dtype)."""
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()  # num_seqs + 1 ints: the per-sequence plan is host-side
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    decode_seqs = [i for i in range(num_seqs) if starts[i + 1] - starts[i] == 1]
    if decode_seqs and len(decode_seqs) == num_seqs == q.shape[0]:  # pure decode: no scatter
        return _decode_chunked(q, key_cache, value_cache, block_tables, seq_lens, lens, scale, window, sinks)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    # Decodes and short chunks (speculative verification: 1 + k tokens) as decode rows in one batched
    # pass: query token j of an n-token chunk is a decode of a sequence `seq_len - n + 1 + j` long
    # (exactly its causal view), so a verification batch costs no per-sequence loop on the host.
    row_seqs, row_lens, rows = [], [], []
    for i in range(num_seqs):
        n = starts[i + 1] - starts[i]
        if 1 <= n <= SHORT_CHUNK:
            row_seqs += [i] * n
            row_lens += range(lens[i] - n + 1, lens[i] + 1)
            rows += range(starts[i], starts[i + 1])
    if rows:
        idx = torch.tensor(row_seqs, device=q.device)
        at = torch.tensor(rows, device=q.device)
        out[at] = _decode_chunked(q[at], key_cache, value_cache, block_tables[idx],
                                  torch.tensor(row_lens, dtype=seq_lens.dtype, device=q.device), row_lens,
                                  scale, window, sinks)
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end - start <= SHORT_CHUNK:  # done above; empty sequences produce nothing
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        out[start:end] = _prefill_one(q[start:end], key_cache, value_cache, blocks, seq_len, scale, window, sinks)
    return out
