"""Pure-torch batched LoRA (reference and CPU path): shrink and expand over tokens grouped by adapter.

A step mixes tokens of several adapters (and of none). Every adapter lives in a device *slot*:
``a [S, R, K]`` (each slot's A matrices, parts stacked along R) and ``b [S, N, r]`` (its B rows,
the LoRA scaling folded in). Each token names its slot (``slot_ids [T]``, -1: no adapter), and

* shrink: ``h[t] = a[slot[t]] @ x[t]``        (``[T, K] -> [T, R]``)
* expand: ``y[t, cols_i] += b[slot[t], cols_i] @ h[t, i*r:(i+1)*r]`` for each slice ``i``

where a fused projection (q/k/v, gate/up) has one slice per part: its output columns are cut at
``slice_starts`` and slice ``i`` reads its own ``r`` columns of ``h``. Tokens without an adapter
are left alone (their rows of ``h`` are unspecified, ``y`` is not touched).

The plan (``LoRAPlan``) is built once per step and reused by every layer, as the Punica/S-LoRA
segmented kernels (SGMV) and vLLM's ``LoRAKernelMeta`` do: here, the rows of each slot that
occurs, read on the host once (the CPU path); a slot holding every token of the step takes the
matmul on all rows, with no gather. The Triton path (``lora_triton``) groups the same rows on the
device, padded to whole blocks (``moe_align``), without any host read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LoRAPlan(NamedTuple):
    """One step's token grouping by adapter slot, for ``lora_shrink`` / ``lora_expand``."""

    slot_ids: torch.Tensor      # [T] int32, -1: no adapter
    num_slots: int
    # Reference: (slot, rows) for each slot that occurs; rows None = every token of the step.
    groups: tuple[tuple[int, torch.Tensor | None], ...] | None = None
    # Triton: sorted token rows [max_padded], each block's slot [max_padded // block_m] (num_slots:
    # no adapter), the padded length used [1] (``moe_align.moe_align_block_size``).
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block_m: int = 0


def lora_plan_ref(slot_ids: torch.Tensor, num_slots: int) -> LoRAPlan:
    """Group the tokens of a step by slot (one host read of the slots present)."""
    num_tokens = slot_ids.shape[0]
    groups = []
    for slot in torch.unique(slot_ids).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slot_ids == slot).squeeze(1)
        groups.append((slot, None if rows.numel() == num_tokens else rows))
    return LoRAPlan(slot_ids, num_slots, tuple(groups))


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan) -> torch.Tensor:
    """``x [T, K]``, ``a [S, R, K]`` -> ``h [T, R]`` in x's dtype (see the module docstring)."""
    h = x.new_empty((x.shape[0], a.shape[1]))
    for slot, rows in plan.groups:
        if rows is None:
            torch.mm(x, a[slot].t(), out=h)
        else:
            h.index_copy_(0, rows, torch.mm(x.index_select(0, rows), a[slot].t()))
    return h


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
                    slice_starts: tuple[int, ...]) -> None:
    """``y [T, N] += `` each token's ``b [S, N, r]`` times its ``h [T, len(slice_starts) * r]``, in place."""
    rank, num_cols = b.shape[2], b.shape[1]
    bounds = (*slice_starts, num_cols)
    for slot, rows in plan.groups:
        weights = b[slot]                                                     # [N, r]
        for i in range(len(slice_starts)):
            lo, hi = bounds[i], bounds[i + 1]
            part = h[:, i * rank:(i + 1) * rank]                              # [T, r]
            if rows is None:
                y[:, lo:hi].addmm_(part, weights[lo:hi].t())
            else:
                y[:, lo:hi].index_add_(0, rows, torch.mm(part.index_select(0, rows), weights[lo:hi].t()))
