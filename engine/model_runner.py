"""Turns a `SchedulerOutput` into tensors, runs the model once, returns logits of sampled rows.

Plan once, run per layer: the slot mapping, block tables and sequence offsets are built here once
per step (vectorised in numpy: Python touches each sequence a few times and never loops per
token; ~0.3 ms for 256 sequences) and handed to every layer in `AttentionMetadata`.

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

import numpy as np
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
        """scheduled: sequence of ScheduledSeq -> (input_ids, positions, metadata, logits_indices).

        Host-side planning is numpy: `np.fromiter` reads Python ints ~3x faster than
        `torch.tensor(list)`, and numpy's per-op overhead is a fraction of torch's on small arrays."""
        num_seqs = len(scheduled)
        q_lens = np.fromiter((len(seq.token_ids) for seq in scheduled), np.int64, num_seqs)        # [S]
        n_blocks = np.fromiter((len(seq.block_ids) for seq in scheduled), np.int64, num_seqs)      # [S]
        start_pos = np.fromiter((seq.start_position for seq in scheduled), np.int64, num_seqs)    # [S]
        sample = np.fromiter((seq.sample for seq in scheduled), np.bool_, num_seqs)               # [S]
        num_tokens = int(q_lens.sum())
        input_ids = np.fromiter(itertools.chain.from_iterable(seq.token_ids for seq in scheduled),
                                np.int64, num_tokens)                                            # [T]

        # Block table [S, max_blocks]: the ragged block lists, left-aligned, zero-padded.
        max_blocks = int(n_blocks.max()) if num_seqs else 0
        table = np.zeros((num_seqs, max(max_blocks, 1)), np.int32)
        flat_blocks = np.fromiter(itertools.chain.from_iterable(seq.block_ids for seq in scheduled),
                                  np.int32, int(n_blocks.sum()))
        table[np.arange(table.shape[1]) < n_blocks[:, None]] = flat_blocks  # row-major = concat order

        query_start_loc = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        if (q_lens == 1).all():  # decode-only step: one token per sequence
            seq_index = np.arange(num_seqs)
            positions = start_pos
        else:
            seq_index = np.repeat(np.arange(num_seqs), q_lens)                                # [T]
            positions = start_pos[seq_index] + (np.arange(num_tokens) - query_start_loc[seq_index])  # [T]
        block_of_token = table[seq_index, positions // self.block_size].astype(np.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size        # [T]
        seq_lens = start_pos + q_lens                                                         # [S]
        logits_indices = query_start_loc[1:][sample] - 1  # the last token of each sampling sequence

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table).to(dev),
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        )
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta,
                torch.from_numpy(logits_indices).to(dev))

    @torch.inference_mode()
    def run(self, scheduled) -> torch.Tensor:
        """Returns logits `[num_sampled_seqs, vocab]` in the model dtype (the sampler upcasts),
        rows in the order of `scheduled`; only the sampled rows go through the lm_head."""
        input_ids, positions, meta, logits_indices = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)      # [T, hidden]
        if logits_indices.shape[0] != hidden.shape[0]:  # decode-only steps sample every row: no copy
            hidden = hidden[logits_indices]
        return self.model.compute_logits(hidden)
