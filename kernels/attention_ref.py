"""Pure-torch paged attention: the reference for the Triton kernels and the CPU runtime path.

Design: the math is fp32. Decode rows (query_len == 1) of all sequences are padded to the
longest context and done in one batched SDPA call; sequences with several query tokens (prefill
chunks) get one SDPA call each with an explicit bottom-right causal mask. GQA is packed the same
way as in the kernel: the query heads of one KV group become extra query rows, so K/V are never
repeated per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Gather the first ``length`` tokens of one sequence: -> [num_kv_heads, length, head_dim] fp32."""
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_ids: [n_blocks] int64
    kv = cache[block_ids].flatten(0, 1)[:length]  # [length, num_kv_heads, head_dim]
    return kv.transpose(0, 1).float()


def _prefill_one(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    k: torch.Tensor,  # [num_kv_heads, seq_len, head_dim] fp32
    v: torch.Tensor,  # [num_kv_heads, seq_len, head_dim] fp32
    scale: float,
) -> torch.Tensor:
    query_len, num_heads, head_dim = q.shape
    num_kv_heads, seq_len, _ = k.shape
    group = num_heads // num_kv_heads
    context_len = seq_len - query_len
    # rows = (head_in_group, q_pos): [num_kv_heads, group * query_len, head_dim]
    qg = q.float().view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * query_len, head_dim)
    q_pos = torch.arange(query_len, device=q.device).repeat(group)  # [group * query_len]
    k_pos = torch.arange(seq_len, device=q.device)
    mask = k_pos[None, :] <= (context_len + q_pos)[:, None]  # [group * query_len, seq_len]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(query_len, num_heads, head_dim)


def _decode_batch(
    q: torch.Tensor,  # [n, num_heads, head_dim]: one query token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [n, max_blocks] int32
    seq_lens: torch.Tensor,  # [n] int64, on q's device
    max_len: int,
    scale: float,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = -(-max_len // block_size)
    table = block_tables[:, :n_blocks].long()
    # Entries past a sequence's last block may hold anything: point them at block 0 (masked anyway).
    used = torch.arange(n_blocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    table = torch.where(used, table, torch.zeros_like(table))

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [n, num_kv_heads, n_blocks*block_size, head_dim]
        return cache[table].flatten(1, 2).transpose(1, 2).float()

    k, v = gather(key_cache), gather(value_cache)
    qg = q.float().view(n, num_kv_heads, group, head_dim)
    k_pos = torch.arange(n_blocks * block_size, device=q.device)
    mask = (k_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [n, 1, 1, padded_len]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Paged causal attention in fp32 torch: ``[num_tokens, num_heads, head_dim]`` in ``out_dtype``
    (default q's dtype; tests ask for fp32 to compare half-precision kernels without rounding)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode_seqs:
        idx = torch.tensor(decode_seqs, device=q.device)
        rows = query_start_loc.long()[idx]
        dec_lens = seq_lens.long()[idx]
        out[rows] = _decode_batch(q[rows], key_cache, value_cache, block_tables[idx], dec_lens,
                                  max(lens[i] for i in decode_seqs), scale)
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end - start <= 1:  # decode rows done above; empty sequences produce nothing
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = _gather_kv(key_cache, blocks, seq_len)
        v = _gather_kv(value_cache, blocks, seq_len)
        out[start:end] = _prefill_one(q[start:end], k, v, scale)
    return out.to(out_dtype or q.dtype)
