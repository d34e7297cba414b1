"""Per-step attention metadata: planned once per step by the runner, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32
    lora_slots: torch.Tensor | None = None   # [num_tokens] int32 LoRA adapter slot (-1: none); None: no adapter
    # KV groups 1.. (engine.kv_groups: a mixed local/global model): each group's own slot mapping
    # and block tables, the rest shared with this one (group 0's); () with one group.
    group_metas: tuple[AttentionMetadata, ...] = ()
