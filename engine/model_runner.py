"""Turns a `SchedulerOutput` into tensors, runs the model once, returns logits of sampled rows.

Plan once, run per layer: the slot mapping, block tables and sequence offsets are built here once
per step (vectorised, no per-token Python loop) and handed to every layer in `AttentionMetadata`.
"""

from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.model import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, KVH, D]
        self.block_size = block_size
        self.device = device

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """scheduled: sequence of ScheduledSeq -> (input_ids, positions, metadata, logits_indices)."""
        token_ids: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []
        logits_indices: list[int] = []
        max_blocks = 1
        for seq in scheduled:
            token_ids.extend(seq.token_ids)
            query_lens.append(len(seq.token_ids))
            starts.append(seq.start_position)
            if seq.sample:
                logits_indices.append(len(token_ids) - 1)
            max_blocks = max(max_blocks, len(seq.block_ids))
        num_seqs = len(query_lens)
        table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        for i, seq in enumerate(scheduled):
            if seq.block_ids:
                table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)

        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        start_pos = torch.tensor(starts, dtype=torch.int64)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens)          # [T]
        offset_in_query = torch.arange(len(token_ids)) - query_start_loc[:-1][seq_index]
        positions = start_pos[seq_index] + offset_in_query                          # [T]
        block_of_token = table[seq_index, positions // self.block_size].to(torch.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        seq_lens = start_pos + q_lens

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(torch.int32).to(dev),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            block_tables=table.to(dev),
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        return input_ids, positions.to(dev), meta, torch.tensor(logits_indices, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def run(self, scheduled) -> torch.Tensor:
        """Returns fp32 logits `[num_sampled_seqs, vocab]`, rows in the order of `scheduled`."""
        input_ids, positions, meta, logits_indices = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden[logits_indices])
