"""A step's input tensors: planned in numpy, staged in ONE host buffer, sent in ONE copy.

Design: every per-step input (token ids, positions, slot mapping, sequence offsets, context
lengths, block table, the rows to sample, and the rows whose token is still on the device) is a
typed view into one byte buffer. The host fills the views with numpy, then one non-blocking
`copy_` moves exactly the bytes in use to a persistent device buffer of the same layout. On CUDA
the host side is pinned, so the copy is asynchronous and the step never waits for it; an event
recorded after the copy tells the next step when the staging buffer may be overwritten (with
async scheduling the host plans step N+1 while step N, and possibly its copy, is still queued).
On CPU the device buffer *is* the host buffer: no copy at all.

The layout depends only on (num_tokens, num_seqs, block-table width): fixed-size fields first,
variable ones (`logits_indices`, `fill_*`) last. So a CUDA graph captured for a padded decode
bucket reads its inputs at the same addresses every replay (`engine.cuda_graphs`).

Padding rows (decode buckets larger than the batch) get token 0, position 0, slot -1 (the KV
write skips it), context length 1 and block row 0 (the null block): the kernels run them
harmlessly and the runner drops their logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_metadata import AttentionMetadata
from engine.scheduler_output import PLACEHOLDER_TOKEN_ID

_ALIGN = 8


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every field for one (num_tokens, num_seqs, width, num_sampled, num_fill)."""

    num_tokens: int
    num_seqs: int
    width: int
    num_sampled: int
    num_fill: int

    @property
    def fields(self) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
        t, s, w = self.num_tokens, self.num_seqs, self.width
        return (("input_ids", np.int64, (t,)), ("positions", np.int64, (t,)),
                ("slot_mapping", np.int64, (t,)), ("query_start_loc", np.int32, (s + 1,)),
                ("seq_lens", np.int32, (s,)), ("block_tables", np.int32, (s, w)),
                ("logits_indices", np.int64, (self.num_sampled,)),
                ("fill_dst", np.int64, (self.num_fill,)), ("fill_src", np.int64, (self.num_fill,)))

    def offsets(self) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
        """(name, dtype, shape, byte offset, byte size) per field, each offset 8-byte aligned."""
        out, offset = [], 0
        for name, dtype, shape in self.fields:
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out.append((name, dtype, shape, offset, size))
            offset = _aligned(offset + size)
        return out

    @property
    def nbytes(self) -> int:
        name, dtype, shape, offset, size = self.offsets()[-1]
        return offset + size


def max_layout_bytes(max_num_tokens: int, max_num_seqs: int, max_width: int) -> int:
    return Layout(max_num_tokens, max_num_seqs, max_width, max_num_seqs, max_num_seqs).nbytes + 64


@dataclass
class StepTensors:
    """The device-side views of one step's inputs."""

    input_ids: torch.Tensor         # [T] int64
    positions: torch.Tensor         # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # [num_sampled] int64: token rows that go through the head
    fill_dst: torch.Tensor          # [P] int64: token rows whose id is on the device...
    fill_src: torch.Tensor          # [P] int64: ...in row fill_src of the previous step's sample
    num_seqs: int                   # real sequences (rows past it are padding)
    layout: Layout


class StepInputs:
    """The staging buffers of one model runner (see the module docstring)."""

    def __init__(self, capacity_bytes: int, block_size: int, device: torch.device, growable: bool = True) -> None:
        """`growable`: a step larger than the buffers reallocates them (eager steps); CUDA graphs
        read fixed addresses, so their staging is sized for the largest bucket and never grows."""
        self.block_size = block_size
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.growable = growable
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._allocate(capacity_bytes)

    def _allocate(self, capacity_bytes: int) -> None:
        self.host = torch.zeros(capacity_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.device_buf = self.host if self.on_cpu else torch.zeros(capacity_bytes, dtype=torch.uint8,
                                                                    device=self.device)

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def views(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Device views of every field (the same addresses for the same layout)."""
        buf = self.device_buf
        return {name: buf[off:off + size].view(_TORCH[np.dtype(dtype)]).view(shape)
                for name, dtype, shape, off, size in layout.offsets()}

    def _host_views(self, layout: Layout) -> dict[str, np.ndarray]:
        buf = self.host_np
        return {name: buf[off:off + size].view(dtype).reshape(shape)
                for name, dtype, shape, off, size in layout.offsets()}

    def prepare(self, scheduled, pad_to: int | None = None, width: int | None = None,
                prev_rows: dict[str, int] | None = None, extra_logits_rows: np.ndarray | None = None) -> StepTensors:
        """scheduled: sequence of ScheduledSeq -> the step's device tensors.

        `pad_to` (decode-only batches): pad to this many sequences; `width`: block-table width
        (default: the widest table of the batch). `prev_rows` maps the request id of every seq
        whose token is `PLACEHOLDER_TOKEN_ID` to its row in the previous step's sampled ids.
        `extra_logits_rows` (eager steps): more token rows for the head, after the sampled ones
        (prompt logprobs, `engine.prompt_logprobs`).

        Host-side planning is numpy: `np.fromiter` reads Python ints ~3x faster than
        `torch.tensor(list)`, and numpy's per-op overhead is a fraction of torch's on small arrays."""
        num_real = len(scheduled)
        q_lens = np.fromiter((len(seq.token_ids) for seq in scheduled), np.int64, num_real)        # [S]
        n_blocks = np.fromiter((len(seq.block_ids) for seq in scheduled), np.int64, num_real)      # [S]
        start_pos = np.fromiter((seq.start_position for seq in scheduled), np.int64, num_real)    # [S]
        sample = np.fromiter((seq.sample for seq in scheduled), np.bool_, num_real)               # [S]
        num_real_tokens = int(q_lens.sum())
        max_blocks = max(int(n_blocks.max()) if num_real else 0, 1)
        width = max_blocks if width is None else width
        num_seqs = num_real if pad_to is None else pad_to
        num_tokens = num_real_tokens + (num_seqs - num_real)        # padding rows are decodes
        ids = np.fromiter(itertools.chain.from_iterable(seq.token_ids for seq in scheduled),
                          np.int64, num_real_tokens)                                            # [T]
        fill_dst = np.flatnonzero(ids == PLACEHOLDER_TOKEN_ID)
        num_sampled = int(sample.sum()) if pad_to is None else num_seqs
        num_extra = 0 if extra_logits_rows is None else len(extra_logits_rows)
        layout = Layout(num_tokens, num_seqs, width, num_sampled + num_extra, len(fill_dst))
        self._wait_for_last_copy()
        if layout.nbytes > self.capacity:
            if not self.growable:
                raise ValueError(f"step inputs need {layout.nbytes} bytes, staging holds {self.capacity}")
            self._allocate(2 * layout.nbytes)   # the old device buffer stays alive while in use
        h = self._host_views(layout)

        input_ids, positions, slots = h["input_ids"], h["positions"], h["slot_mapping"]
        qsl, seq_lens, table = h["query_start_loc"], h["seq_lens"], h["block_tables"]
        input_ids[:num_real_tokens] = ids
        if fill_dst.size:
            input_ids[fill_dst] = 0
            h["fill_dst"][:] = fill_dst
            tokens_seq = np.searchsorted(np.cumsum(q_lens), fill_dst, side="right")
            h["fill_src"][:] = [prev_rows[scheduled[i].request_id] for i in tokens_seq.tolist()]

        # Block table [S, width]: the ragged block lists, left-aligned, zero-padded.
        table.fill(0)
        flat_blocks = np.fromiter(itertools.chain.from_iterable(seq.block_ids for seq in scheduled),
                                  np.int32, int(n_blocks.sum()))
        table[:num_real][np.arange(width) < n_blocks[:, None]] = flat_blocks  # row-major = concat order

        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:num_real + 1])
        if num_tokens == num_seqs:  # decode-only step: one token per sequence
            seq_index = np.arange(num_real)
            pos = start_pos
        else:
            seq_index = np.repeat(np.arange(num_real), q_lens)                                   # [T]
            pos = start_pos[seq_index] + (np.arange(num_real_tokens) - qsl[seq_index])           # [T]
        positions[:num_real_tokens] = pos
        block_of_token = table[seq_index, pos // self.block_size].astype(np.int64)
        slots[:num_real_tokens] = block_of_token * self.block_size + pos % self.block_size    # [T]
        seq_lens[:num_real] = start_pos + q_lens                                             # [S]
        if pad_to is None:
            h["logits_indices"][:num_sampled] = qsl[1:][sample] - 1  # the last token of each sampling sequence
            if num_extra:
                h["logits_indices"][num_sampled:] = extra_logits_rows
        else:
            h["logits_indices"][:] = np.arange(num_seqs)
        if num_seqs > num_real:   # padding rows: harmless decodes of the null block
            input_ids[num_real_tokens:] = 0
            positions[num_real_tokens:] = 0
            slots[num_real_tokens:] = -1
            qsl[num_real + 1:] = num_real_tokens + np.arange(1, num_seqs - num_real + 1)
            seq_lens[num_real:] = 1

        if not self.on_cpu:
            self.device_buf[:layout.nbytes].copy_(self.host[:layout.nbytes], non_blocking=True)
            self._copied.record()
        return self.tensors(layout, num_real)

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the device buffer, grown if needed: where a tensor-parallel rank
        receives rank 0's staged step (`engine.tp_comm`)."""
        if nbytes > self.capacity:
            self._allocate(2 * nbytes)
        return self.device_buf[:nbytes]

    def tensors(self, layout: Layout, num_seqs: int | None = None) -> StepTensors:
        """The step tensors over the device buffer as it holds `layout` now."""
        dev = self.views(layout)
        num_real = layout.num_seqs if num_seqs is None else num_seqs
        meta = AttentionMetadata(slot_mapping=dev["slot_mapping"], query_start_loc=dev["query_start_loc"],
                                 seq_lens=dev["seq_lens"], block_tables=dev["block_tables"])
        return StepTensors(dev["input_ids"], dev["positions"], meta, dev["logits_indices"],
                           dev["fill_dst"], dev["fill_src"], num_real, layout)

    def _wait_for_last_copy(self) -> None:
        # The host buffer is about to be overwritten: the previous step's copy must have read it.
        if self._copied is not None:
            self._copied.synchronize()


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
