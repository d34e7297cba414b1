"""The paged KV cache: ONE allocation `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`.

Keeping every block one contiguous byte range across layers lets a transfer move a run of blocks
as one message (vLLM measured >2x TTFT in P/D from this); each layer sees strided
`[num_blocks, block_size, kv_heads, head_dim]` views, and the kernels take every stride. With KV
groups (`engine.kv_groups`: a mixed local/global model) the second dimension is `slots`, the
layers of one group: a block (page) holds one group's KV and each group has its own tables.
"""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, slots: int | None = None) -> int:
    """Bytes of one block: `slots` layers' KV (default: every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (slots or cfg.num_layers) * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for_memory(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int,
                          slots: int | None = None) -> int:
    return max(2, memory_bytes // bytes_per_block(cfg, block_size, dtype, slots))


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, slots: int | None = None) -> torch.Tensor:
    return torch.zeros(num_blocks, slots or cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype, device=device)
