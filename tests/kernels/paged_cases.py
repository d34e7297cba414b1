"""Builders for paged-attention test cases: dense per-sequence K/V scattered into an
engine-layout KV allocation through a shuffled block table, plus a naive dense attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] strided view
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_case(
    specs: list[tuple[int, int]],  # per sequence (context_len, query_len)
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    first_block: int = 1,
    num_blocks: int | None = None,
    extra_table_cols: int = 2,
    seed: int = 0,
) -> PagedCase:
    """Engine layout ``[num_blocks, num_layers=2, 2, block_size, kv_heads, head_dim]``, layer 1 used.

    Blocks are drawn shuffled from ``first_block`` upwards (block 0 stays the null block); with
    a large ``first_block`` and ``num_blocks`` the allocation is huge but only used blocks are
    touched (``torch.empty`` on CPU commits pages lazily).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    n_per_seq = [-(-s // block_size) for s in seq_lens]
    total = sum(n_per_seq)
    if num_blocks is None:
        num_blocks = first_block + total + 3
    kv = torch.empty((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    used = (first_block + torch.randperm(num_blocks - first_block, generator=gen)[:total]).tolist()
    kv[0].zero_()
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    width = max(n_per_seq, default=0) + extra_table_cols
    table = torch.zeros((len(specs), width), dtype=torch.int32)
    keys, values, queries = [], [], []
    for i, (seq_len, n) in enumerate(zip(seq_lens, n_per_seq)):
        blocks, used = used[:n], used[n:]
        table[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        for j, b in enumerate(blocks):
            chunk = slice(j * block_size, min((j + 1) * block_size, seq_len))
            kv[b].normal_()  # garbage in the unused tail of the last block: must be masked
            key_cache[b, : chunk.stop - chunk.start] = k[chunk].to(device)
            value_cache[b, : chunk.stop - chunk.start] = v[chunk].to(device)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn((specs[i][1], num_kv_heads * group, head_dim), generator=gen).to(dtype))
    qsl = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedCase(
        q=torch.cat(queries).to(device), key_cache=key_cache, value_cache=value_cache,
        block_tables=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), keys=keys, values=values, scale=1.0 / math.sqrt(head_dim),
    )


def naive_attention(case: PagedCase, sliding_window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense causal attention per sequence and head in float64, from the unpaged K/V; with a
    sliding window (a query at p sees keys (p - window, p]) and sinks (transformers' gpt-oss:
    softmax over the scores and one logit per head, whose column is then dropped)."""
    q = case.q.cpu().double()
    out = torch.zeros_like(q)
    starts = case.query_start_loc.tolist()
    group = q.shape[1] // case.keys[0].shape[1] if case.keys else 1
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        qi = q[starts[i]: starts[i + 1]]  # [query_len, num_heads, head_dim]
        query_len, seq_len = qi.shape[0], k.shape[0]
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * case.scale
        q_pos = torch.arange(query_len)[:, None] + (seq_len - query_len)
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.double().cpu()[:, None, None].expand(-1, query_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        out[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
