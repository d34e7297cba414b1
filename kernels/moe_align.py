"""Tokens sorted by expert and padded to whole blocks, on the device, without a host read.

The grouped GEMM of the fused MoE kernel (``moe_triton``) runs one program per ``block_m`` rows,
each block belonging to one expert. ``moe_align_block_size`` (vLLM's name for the same step)
flattens the ``[T, top_k]`` routing into ``T * top_k`` slots (slot ``t * top_k + k``), sorts the
slots by expert (stable: a token's slots keep their order within an expert), pads every expert's
run up to a multiple of ``block_m`` with the sentinel ``T * top_k``, and says which expert each
block belongs to. Experts with no tokens get no block.

Every output has a shape fixed by ``(T, top_k, num_experts, block_m)`` alone and nothing reads a
value back to the host, so it runs inside a CUDA graph; blocks past ``num_padded`` (a device
scalar) are left for the kernel to skip. Pure torch (cumsum, a stable argsort, searchsorted):
the same code runs, and is tested, on CPU.
"""

from __future__ import annotations

import torch


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded length: at most ``min(E, slots)`` experts get tokens, each
    padding fewer than ``block_m`` slots; rounded up to whole blocks."""
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, top_k]`` (values in ``[0, num_experts)``) ->

    * ``sorted_slots`` int32 ``[max_padded_slots]``: slot ids grouped by expert, each expert's run
      padded to a multiple of ``block_m`` with ``T * top_k``; the tail past ``num_padded`` too;
    * ``block_experts`` int32 ``[max_padded_slots // block_m]``: the expert of each block (blocks
      past ``num_padded`` hold a valid but unused expert id);
    * ``num_padded`` int32 ``[1]``: the padded length actually used.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)                          # [N] slot -> expert
    n, device = flat.numel(), flat.device
    length = max_padded_slots(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))                                  # [E] slots per expert
    padded = (counts + (block_m - 1)) // block_m * block_m               # [E]
    padded_end = torch.cumsum(padded, 0)                                 # [E] inclusive
    order = torch.argsort(flat, stable=True)                             # [N] slots by expert
    experts = flat.index_select(0, order)                                # [N] their experts
    first = torch.cumsum(counts, 0) - counts                             # [E] unpadded starts
    rank = torch.arange(n, device=device) - first.index_select(0, experts)   # place within its expert
    dest = (padded_end - padded).index_select(0, experts) + rank         # [N] padded position
    sorted_slots = torch.full((length,), n, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, length, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_slots, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)
