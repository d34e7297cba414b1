"""Shared fixtures-as-functions for the kvtransfer tests: tiny KV caches with known contents."""

from __future__ import annotations

import torch

from kvtransfer.layout import KVLayout

TINY = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def make_kv(layout: KVLayout = TINY, num_blocks: int = 16, seed: int = 0) -> torch.Tensor:
    """A KV cache `[num_blocks, *layout.block_shape]` of random values (block 0 zeroed: null)."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn((num_blocks, *layout.block_shape), generator=generator).to(layout.dtype)
    kv[0].zero_()
    return kv


def empty_like_kv(kv: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(kv)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN-safe, dtype-agnostic)."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
