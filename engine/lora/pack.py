"""An adapter's slot image: its A and B tensors laid out as one slot row of `LoRAModel.storage`.

Built on the host, off the engine thread (when the adapter is read), once per tensor-parallel
rank: each rank's row holds its shard, cut exactly as the base layer is cut
(`engine.tp.shard.TPShard.split` on the projection's own parameter and part): B's rows for a
column-parallel part, A's columns for a row-parallel one. The LoRA scaling is folded into B (in
fp32, then rounded to the model dtype once); ranks below the slot rank and modules the adapter
does not target stay zero, so they add nothing. Loading the adapter into a slot is then one copy
of one contiguous row (pinned on CUDA, so the copy is asynchronous).
"""

from __future__ import annotations

import torch

from engine.lora.adapter import AdapterWeights
from engine.lora.layers import LoRATarget


def _local(tensor: torch.Tensor, plan, dim: int) -> torch.Tensor:
    """`tensor`'s slice along `dim` that one rank owns (`plan`: a `SplitPlan` of that dim, or None)."""
    if plan is None or plan.dim != dim:
        return tensor
    parts = [tensor.narrow(dim, r.start, len(r)) for r in plan.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _per_part(target: LoRATarget, parts: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) per part; an adapter of a whole module (part None: an unfused projection, or a
    checkpoint's fused one) gives every part the same A and its own rows of B."""
    if None not in parts:
        return parts
    a, b = parts[None]
    out, start = {}, 0
    for p, (rows, _) in enumerate(target.global_shapes):
        out[p] = (a, b[start:start + rows])
        start += rows
    return out


def slot_images(weights: AdapterWeights, targets: dict[str, LoRATarget], slot_numel: int, dtype: torch.dtype,
                shards: list, pin_memory: bool = False) -> list[torch.Tensor]:
    """One `[slot_numel]` image per rank (`shards[r]`: rank r's `TPShard`, or None without
    tensor parallelism), in `dtype`."""
    rank_of_adapter, scaling = weights.config.rank, weights.config.scaling
    images = []
    for shard in shards:
        image = torch.zeros(slot_numel, dtype=dtype, pin_memory=pin_memory)
        for path, parts in weights.modules.items():
            t = targets[path]
            a_view = image[t.a_offset:t.a_offset + t.a_numel].view(t.num_parts * t.rank, t.in_features)
            b_view = image[t.b_offset:t.b_offset + t.b_numel].view(t.out_features, t.rank)
            for p, (a, b) in _per_part(t, parts).items():
                plan = None if shard is None or shard.size == 1 else shard.split(
                    t.param, p if t.num_parts > 1 else None)
                a_view[p * t.rank:p * t.rank + rank_of_adapter] = _local(a, plan, 1)
                row = sum(t.part_sizes[:p])
                b_view[row:row + t.part_sizes[p], :rank_of_adapter] = _local(b, plan, 0) * scaling
        images.append(image)
    return images
