"""KV blocks of a tensor-parallel engine as whole-model blocks, for P/D transfer.

Each rank's cache holds only its KV heads (`engine.tp.shard`). On the wire a block always has
every KV head (`KVLayout` with the model's `num_kv_heads`), whatever the tensor-parallel degree of
either pod, so a prefill pod at TP=p and a decode pod at TP=d exchange blocks with no mapping
beyond this module: the source's rank 0 gathers a run's heads from its ranks (one `gather` over
the group, between steps), the destination's rank 0 hands each rank exactly the heads it owns (one
`scatter`). A replicated head (fewer KV heads than ranks) is read from its first owner and written
to every owner. Transfers pass through rank 0 of each pod: direct rank-to-rank pulls would save
that hop and are not built.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from engine.model_config import ModelConfig
from engine.tp.comm import CMD_KV_GATHER, CMD_KV_SCATTER, TPComm
from engine.tp.shard import TPShard


def _owned(cfg: ModelConfig, size: int) -> list[range]:
    return [TPShard(cfg, r, size).kv_heads for r in range(size)]


def full_blocks(parts: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Every rank's `[n, L, 2, bs, local_kv_heads, D]` -> `[n, L, 2, bs, num_kv_heads, D]`."""
    n, layers, two, bs, _, d = parts[0].shape
    out = parts[0].new_empty((n, layers, two, bs, cfg.num_kv_heads, d))
    for heads, part in zip(_owned(cfg, len(parts)), parts):
        out[:, :, :, :, heads.start:heads.stop] = part
    return out


def rank_blocks(full: torch.Tensor, cfg: ModelConfig, size: int) -> list[torch.Tensor]:
    """`[n, L, 2, bs, num_kv_heads, D]` -> each rank's own heads, contiguous."""
    return [full[:, :, :, :, heads.start:heads.stop].contiguous() for heads in _owned(cfg, size)]


class TPKVBlocks:
    """Rank 0's whole-model view of the group's KV cache (`read` / `write` block ids)."""

    def __init__(self, driver, kv_cache: torch.Tensor, cfg: ModelConfig) -> None:
        self.driver, self.kv, self.cfg = driver, kv_cache, cfg   # cfg: the global config

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """`[n, L, 2, bs, num_kv_heads, D]` on CPU, gathered from every rank."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv.device)
        with self._device(), self.driver.exclusive(CMD_KV_GATHER, len(ids)) as comm:
            comm.broadcast(ids)
            parts = comm.gather_to_first(_as_bytes(self.kv.index_select(0, ids)))
            return full_blocks([p.view(self.kv.dtype) for p in parts], self.cfg).cpu()

    def write(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """`blocks` `[n, L, 2, bs, num_kv_heads, D]` into `block_ids` of every rank's cache."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv.device)
        parts = [_as_bytes(p) for p in rank_blocks(blocks.to(self.kv.device), self.cfg, self.driver.comm.size)]
        with self._device(), self.driver.exclusive(CMD_KV_SCATTER, len(ids)) as comm:
            comm.broadcast(ids)
            mine = comm.scatter_from_first(parts, torch.empty_like(parts[0]))
            self.kv.index_copy_(0, ids, mine.view(self.kv.dtype))

    def _device(self):
        # Transfers run in worker threads: NCCL needs the rank's device current there.
        return torch.cuda.device(self.kv.device) if self.kv.is_cuda else contextlib.nullcontext()


def _as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    # Collectives move raw bytes: Gloo has no float8, and bytes are all a transfer needs.
    return blocks.contiguous().view(torch.uint8)


def serve_kv_command(comm: TPComm, command: int, count: int, kv_cache: torch.Tensor) -> None:
    """Ranks > 0: their half of `TPKVBlocks.read` / `write` over `count` blocks."""
    ids = comm.broadcast(torch.empty(count, dtype=torch.int64, device=kv_cache.device))
    if command == CMD_KV_GATHER:
        comm.gather_to_first(_as_bytes(kv_cache.index_select(0, ids)))
    elif command == CMD_KV_SCATTER:
        mine = comm.scatter_from_first(None, _as_bytes(kv_cache.new_empty((count, *kv_cache.shape[1:]))))
        kv_cache.index_copy_(0, ids, mine.view(kv_cache.dtype))
