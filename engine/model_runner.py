"""Turns a `SchedulerOutput` into tensors, runs the model once, returns logits of sampled rows.

Plan once, run per layer: the slot mapping, block tables and sequence offsets are built here once
per step (vectorised: Python touches each sequence a few times and never loops per token) and
handed to every layer in `AttentionMetadata`.

CPU runtime: the runner packs the model's weights for oneDNN (`LlamaForCausalLM.pack_weights`)
and keeps glibc from returning freed activation memory to the kernel (`keep_freed_memory`):
every step allocates and frees the same few MB-sized activations, and when glibc serves those
with fresh mmaps, page faults on first touch cost more than the attention math itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import logging

import torch

from engine.attention_metadata import AttentionMetadata
from engine.model import LlamaForCausalLM

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: bigger blocks are always mmapped
_TRIM_THRESHOLD = 1 << 30       # keep up to 1 GiB of freed heap for reuse


@functools.cache
def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and keep freed heap mapped (glibc only).

    Process-wide and idempotent; returns False where there is no glibc `mallopt`."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the CPU allocator settings; step times may suffer from page faults")
    return ok


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, KVH, D]
        self.block_size = block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
            model.pack_weights()

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """scheduled: sequence of ScheduledSeq -> (input_ids, positions, metadata, logits_indices)."""
        num_seqs = len(scheduled)
        q_lens_list = [len(seq.token_ids) for seq in scheduled]
        n_blocks_list = [len(seq.block_ids) for seq in scheduled]
        num_tokens = sum(q_lens_list)
        max_blocks = max(n_blocks_list, default=0) or 1
        input_ids = torch.tensor(list(itertools.chain.from_iterable(seq.token_ids for seq in scheduled)),
                                 dtype=torch.int64)                                  # [T]
        start_pos = torch.tensor([seq.start_position for seq in scheduled], dtype=torch.int64)  # [S]
        q_lens = torch.tensor(q_lens_list, dtype=torch.int64)                        # [S]
        sample = torch.tensor([seq.sample for seq in scheduled], dtype=torch.bool)   # [S]

        # Block table [S, max_blocks]: the ragged block lists, left-aligned, zero-padded.
        flat_blocks = torch.tensor(list(itertools.chain.from_iterable(seq.block_ids for seq in scheduled)),
                                   dtype=torch.int32)
        table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        if num_seqs:
            filled = torch.arange(max_blocks) < torch.tensor(n_blocks_list)[:, None]  # row-major = concat order
            table[filled] = flat_blocks

        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        if num_tokens == num_seqs:  # decode-only step: one token per sequence
            seq_index = torch.arange(num_seqs)
            positions = start_pos
        else:
            seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens, output_size=num_tokens)  # [T]
            offset_in_query = torch.arange(num_tokens) - query_start_loc[:-1][seq_index]
            positions = start_pos[seq_index] + offset_in_query                       # [T]
        block_of_token = table[seq_index, positions // self.block_size].to(torch.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        seq_lens = start_pos + q_lens
        logits_indices = query_start_loc[1:][sample] - 1                             # last token of each sampler

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(torch.int32).to(dev),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            block_tables=table.to(dev),
            max_query_len=max(q_lens_list, default=0),
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        )
        return input_ids.to(dev), positions.to(dev), meta, logits_indices.to(dev)

    @torch.inference_mode()
    def run(self, scheduled) -> torch.Tensor:
        """Returns logits `[num_sampled_seqs, vocab]` in the model dtype (the sampler upcasts),
        rows in the order of `scheduled`; only the sampled rows go through the lm_head."""
        input_ids, positions, meta, logits_indices = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)      # [T, hidden]
        if logits_indices.shape[0] != hidden.shape[0]:  # decode-only steps sample every row: no copy
            hidden = hidden[logits_indices]
        return self.model.compute_logits(hidden)
