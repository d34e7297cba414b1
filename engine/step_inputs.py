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
bucket reads its inputs at the same addresses every replay (`engine.cuda_graphs`). Every field
starts 16-byte aligned: Triton keys each compiled kernel on whether every pointer argument is
16-byte aligned, so 8-byte alignment would make the kernels' variants depend on the batch's
shape (a compile, seconds, in the middle of serving).

Host cost (this runs before every launch): a layout's offsets are computed once (`_offsets`,
memoised, in plain ints), the typed views over both buffers once per (buffer, layout), the block
table only in rows whose table changed (`_fill_block_table`), and a steady decode batch (same
layout and rows as the buffer's previous step) rewrites only what moved: ids, positions, slots,
lengths and the fill rows. The host buffer keeps what it was given, so this is exact.

Padding rows (decode buckets larger than the batch) get token 0, position 0, slot -1 (the KV
write skips it), context length 1 and block row 0 (the null block): the kernels run them
harmlessly and the runner drops their logits.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.attention_metadata import AttentionMetadata
from engine.scheduling.output import PLACEHOLDER_TOKEN_ID, DecodeSeqs

SMALL_BATCH = 16    # sequences: up to this a steady decode batch is staged in plain Python (`_prepare_steady`)
ALIGN = 16    # bytes: Triton's pointer-alignment specialisation (module docstring)
_VIEW_CACHE = 512    # layouts whose views a buffer keeps (decode buckets need a few dozen)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Layout(NamedTuple):
    """Byte offsets of every field for one (num_tokens, num_seqs, width, num_sampled, num_fill, lora).
    A NamedTuple: hashed and compared in C, several times a step (the memoised offsets, the
    cached views, the steady-batch check)."""

    num_tokens: int
    num_seqs: int
    width: int
    num_sampled: int
    num_fill: int
    lora: int = 0      # 1: the step carries each token's LoRA adapter slot (engine/lora/)
    groups: int = 1    # KV groups (engine/kv_groups/): groups 1.. have their own slots and tables

    @property
    def fields(self) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
        t, s, w, g = self.num_tokens, self.num_seqs, self.width, self.groups - 1
        return (("input_ids", np.int64, (t,)), ("positions", np.int64, (t,)),
                ("slot_mapping", np.int64, (t,)), ("lora_slots", np.int32, (t if self.lora else 0,)),
                ("query_start_loc", np.int32, (s + 1,)),
                ("seq_lens", np.int32, (s,)), ("block_tables", np.int32, (s, w)),
                ("group_slots", np.int64, (g, t)), ("group_tables", np.int32, (g, s, w)),
                ("logits_indices", np.int64, (self.num_sampled,)),
                ("fill_dst", np.int64, (self.num_fill,)), ("fill_src", np.int64, (self.num_fill,)))

    def offsets(self) -> tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]:
        """(name, dtype, shape, byte offset, byte size) per field, each offset `ALIGN`-aligned."""
        return _offsets(self)

    @property
    def nbytes(self) -> int:
        name, dtype, shape, offset, size = _offsets(self)[-1]
        return offset + size


_ITEMSIZE = {np.int64: 8, np.int32: 4}


@functools.lru_cache(maxsize=4096)
def _offsets(layout: Layout) -> tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]:
    # Plain ints: np.prod per field cost more than the rest of a decode step's planning.
    out, offset = [], 0
    for name, dtype, shape in layout.fields:
        size = _ITEMSIZE[dtype]
        for n in shape:
            size *= n
        out.append((name, dtype, shape, offset, size))
        offset = _aligned(offset + size)
    return tuple(out)


def max_layout_bytes(max_num_tokens: int, max_num_seqs: int, max_width: int, groups: int = 1) -> int:
    return Layout(max_num_tokens, max_num_seqs, max_width, max_num_seqs, max_num_seqs, 1, groups).nbytes + 64


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
    fill_in_order: bool = False     # fill_dst == fill_src == 0..P-1: the previous sample, as it is

    def fill_from(self, prev_token_ids: torch.Tensor) -> None:
        """Write the tokens still on the device (async scheduling: `prev_token_ids`, the previous
        step's sampled ids) into this step's input ids. A steady batch (same requests, same order)
        takes them with one copy, without the gather's index tensors."""
        num_fill = self.layout.num_fill
        if not num_fill:
            return
        if self.fill_in_order:     # (a slice costs more than the copy: none where the sizes match)
            ids = self.input_ids
            (ids if ids.shape[0] == num_fill else ids[:num_fill]).copy_(
                prev_token_ids if prev_token_ids.shape[0] == num_fill else prev_token_ids[:num_fill])
        else:
            self.input_ids.index_copy_(0, self.fill_dst, prev_token_ids.index_select(0, self.fill_src))


class PrevSample(Mapping[str, int]):
    """The previous step's sampled ids, still on the device (async scheduling): `token_ids[self[id]]`
    is the token of request `id`, whose place in this step's input is `PLACEHOLDER_TOKEN_ID`.
    Built from `rows` (request id -> row) or `ids` (the request id of each row), whose inverse
    map is built on first use only: a batch in the same order as the sample never needs it
    (`StepInputs.prepare` compares the ids)."""

    __slots__ = ("token_ids", "ids", "_rows")

    def __init__(self, token_ids: torch.Tensor, rows: dict[str, int] | None = None,
                 ids: list[str] | None = None) -> None:
        self.token_ids = token_ids      # [num_sampled] int64, on the runner's device
        self.ids = ids
        self._rows = rows

    @property
    def rows(self) -> dict[str, int]:
        if self._rows is None:
            self._rows = dict(zip(self.ids, range(len(self.ids))))
        return self._rows

    def __getitem__(self, request_id: str) -> int:
        return self.rows[request_id]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class StepInputs:
    """The staging buffers of one model runner (see the module docstring)."""

    def __init__(self, capacity_bytes: int, block_size: int, device: torch.device, growable: bool = True,
                 num_groups: int = 1, group_tables: dict[str, tuple[tuple[int, ...], ...]] | None = None) -> None:
        """`growable`: a step larger than the buffers reallocates them (eager steps); CUDA graphs
        read fixed addresses, so their staging is sized for the largest bucket and never grows.
        `num_groups` > 1 (KV groups, `engine.kv_groups`): `group_tables` maps a request id to its
        tables of groups 1.. (`GroupTables.tables`, kept current by the scheduler); a seq missing
        there (warm-up, a TP rank's receiving buffer) reads and writes only the null block in
        those groups."""
        self.block_size = block_size
        self.num_groups = num_groups
        self.group_tables = group_tables if group_tables is not None else {}
        self._no_group_tables = ((),) * (num_groups - 1)
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.growable = growable
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._allocate(capacity_bytes)

    def _allocate(self, capacity_bytes: int) -> None:
        self.host = torch.zeros(capacity_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self._capacity = capacity_bytes
        self.device_buf = self.host if self.on_cpu else torch.zeros(capacity_bytes, dtype=torch.uint8,
                                                                    device=self.device)
        # Views over the buffers just made (the old ones' views die with them), and no table rows
        # (table index -> (key, rows): group 0's, then KV groups 1..).
        self._table_state: dict[int, tuple[tuple, list]] = {}
        self._signature: tuple | None = None
        self._filled_in_order = False       # fill_src holds 0..P-1 (read only while steady)
        self._tensors: StepTensors | None = None   # what the last `prepare` returned
        self._host_cache: dict[Layout, dict[str, np.ndarray]] = {}
        self._device_cache: dict[Layout, tuple[dict[str, torch.Tensor], AttentionMetadata]] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    def views(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Device views of every field (the same addresses for the same layout; do not modify
        the dict: it is cached)."""
        return self._device_views(layout)[0]

    def _device_views(self, layout: Layout) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        cached = self._device_cache.get(layout)
        if cached is None:
            if len(self._device_cache) >= _VIEW_CACHE:    # eager mixed steps: layouts without end
                self._device_cache.clear()
            buf = self.device_buf
            dev = {name: buf[off:off + size].view(_TORCH[dtype]).view(shape)
                   for name, dtype, shape, off, size in _offsets(layout)}
            lora = dev["lora_slots"] if layout.lora else None
            groups = tuple(AttentionMetadata(slot_mapping=dev["group_slots"][g], query_start_loc=dev["query_start_loc"],
                                             seq_lens=dev["seq_lens"], block_tables=dev["group_tables"][g],
                                             lora_slots=lora) for g in range(layout.groups - 1))
            meta = AttentionMetadata(slot_mapping=dev["slot_mapping"], query_start_loc=dev["query_start_loc"],
                                     seq_lens=dev["seq_lens"], block_tables=dev["block_tables"],
                                     lora_slots=lora, group_metas=groups)
            cached = self._device_cache[layout] = (dev, meta)
        return cached

    def _host_views(self, layout: Layout) -> dict[str, np.ndarray]:
        cached = self._host_cache.get(layout)
        if cached is None:
            if len(self._host_cache) >= _VIEW_CACHE:
                self._host_cache.clear()
            buf = self.host_np
            cached = self._host_cache[layout] = {name: buf[off:off + size].view(dtype).reshape(shape)
                                                 for name, dtype, shape, off, size in _offsets(layout)}
        return cached

    def prepare(self, scheduled, pad_to: int | None = None, width: int | None = None,
                prev_rows: dict[str, int] | None = None, extra_logits_rows: np.ndarray | None = None,
                lora_slots: np.ndarray | None = None, kv_lens: np.ndarray | None = None) -> StepTensors:
        """scheduled: sequence of ScheduledSeq -> the step's device tensors.

        `pad_to` (decode-only batches): pad to this many sequences; `width`: block-table width
        (default: the widest table of the batch). `prev_rows` maps the request id of every seq
        whose token is `PLACEHOLDER_TOKEN_ID` to its row in the previous step's sampled ids (a
        `PrevSample` that knows its ids: a batch in their order needs no lookup).
        `extra_logits_rows` (eager steps): more token rows for the head, after the sampled ones
        (prompt logprobs, `engine.prompt_logprobs`).
        `lora_slots` ([num seqs] int32): each seq's LoRA adapter slot (-1: none); None: no adapter.
        `kv_lens` ([num seqs], steps with several tokens a seq): each seq's first tokens whose KV is
        written; the rest are padding (a verification bucket, `engine.spec_decode.verify_graphs`)
        and get slot -1, which the KV write skips.

        Host-side planning is numpy, fed by C-level iteration (`zip(*scheduled)`, `map(len, ...)`,
        `np.fromiter`): a Python-level pass over the batch costs ~50 ns a request, and a decode
        step of 256 requests would otherwise spend more time here than the GPU spends on it."""
        num_real = len(scheduled)
        if num_real <= SMALL_BATCH and self._filled_in_order and lora_slots is None and extra_logits_rows is None:
            t = self._prepare_steady(scheduled, pad_to, width, prev_rows)
            if t is not None:
                return t
        if isinstance(scheduled, DecodeSeqs):     # a steady decode batch as columns: no pass over it
            request_ids, starts, block_lists, samples = scheduled.ids, scheduled.starts, scheduled.tables, (True,)
            num_real_tokens = num_real
            ids = _placeholders(num_real) if scheduled.all_placeholders else np.array(scheduled.token_ids, np.int64)
            fill_dst = _arange(num_real) if scheduled.all_placeholders else np.flatnonzero(ids == PLACEHOLDER_TOKEN_ID)
        elif num_real:
            request_ids, token_lists, starts, block_lists, samples = zip(*scheduled)
            num_real_tokens = sum(map(len, token_lists))
            ids = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, num_real_tokens)  # [T]
            fill_dst = np.flatnonzero(ids == PLACEHOLDER_TOKEN_ID)
        else:
            request_ids = token_lists = starts = block_lists = samples = ()
            num_real_tokens, ids = 0, np.zeros(0, np.int64)
            fill_dst = ids
        decode_only = num_real_tokens == num_real                   # one token per sequence
        if width is None:
            width = max(max(map(len, block_lists), default=0), 1)
        num_seqs = num_real if pad_to is None else pad_to
        num_tokens = num_real_tokens + (num_seqs - num_real)        # padding rows are decodes
        num_fill = len(fill_dst)
        every_seq_samples = pad_to is not None or all(samples)
        if every_seq_samples:
            num_sampled = num_seqs
        else:
            sample = np.array(samples, dtype=np.bool_)                                           # [S]
            num_sampled = int(sample.sum())
        rows = None    # verification (speculative decoding): seq i samples its last rows[i] tokens
        if not decode_only and max(samples) > 1:
            rows = np.array(samples, dtype=np.int64)                                             # [S]
            num_sampled = int(rows.sum())
        num_extra = 0 if extra_logits_rows is None else len(extra_logits_rows)
        layout = Layout(num_tokens, num_seqs, width, num_sampled + num_extra, num_fill, int(lora_slots is not None),
                        self.num_groups)
        self._wait_for_last_copy()
        if layout.nbytes > self.capacity:
            if not self.growable:
                raise ValueError(f"step inputs need {layout.nbytes} bytes, staging holds {self.capacity}")
            self._allocate(2 * layout.nbytes)   # the old device buffer stays alive while in use
        h = self._host_views(layout)
        # A steady decode batch: this buffer's previous step had the same layout and real rows, all
        # decodes, so the fields that depend on nothing else (offsets, sampled rows, padding rows,
        # and with every token on the device the zeroed ids and their rows) still hold its values.
        signature = (layout, num_real, num_fill == num_real) if decode_only and every_seq_samples and not num_extra \
            else None
        steady = signature is not None and signature == self._signature
        self._signature = signature

        input_ids, positions, slots = h["input_ids"], h["positions"], h["slot_mapping"]
        qsl, seq_lens, table = h["query_start_loc"], h["seq_lens"], h["block_tables"]
        if not (steady and num_fill == num_real):
            input_ids[:num_real_tokens] = ids
            if num_fill:
                input_ids[fill_dst] = 0
                h["fill_dst"][:] = fill_dst
        fill_in_order = False
        if num_fill:
            every_fill = decode_only and num_fill == num_real    # async decode: every token is on the device
            if every_fill and isinstance(prev_rows, PrevSample) and prev_rows.ids is not None \
                    and (request_ids is prev_rows.ids or list(request_ids) == prev_rows.ids):  # the sample's order
                if not (steady and self._filled_in_order):      # else it holds 0..P-1 already
                    h["fill_src"][:] = _arange(num_fill)
                fill_in_order = True
            else:
                if every_fill:
                    waiting = request_ids
                else:
                    seq_of = fill_dst if decode_only else np.searchsorted(
                        np.cumsum(np.fromiter(map(len, token_lists), np.int64, num_real)), fill_dst, side="right")
                    waiting = [request_ids[i] for i in seq_of.tolist()]
                rows_of = prev_rows.rows if isinstance(prev_rows, PrevSample) else prev_rows   # (C-level lookups)
                fill_src = list(map(rows_of.__getitem__, waiting))
                h["fill_src"][:] = fill_src
                fill_in_order = every_fill and fill_src == list(range(num_fill))

        self._fill_block_table(table, block_lists, num_seqs, (num_tokens, num_seqs, width))
        start_pos = np.asarray(starts, dtype=np.int64)                                           # [S]
        if decode_only:
            pos = start_pos
            seq_index = _arange(num_real)
            block_of_token = table[seq_index, pos // self.block_size].astype(np.int64)
            seq_lens[:num_real] = pos + 1
            if not steady:
                qsl[:] = np.arange(num_seqs + 1)           # padding rows included: one token each
                h["logits_indices"][:num_sampled] = np.arange(num_sampled) if every_seq_samples else np.flatnonzero(sample)
        else:
            q_lens = np.fromiter(map(len, token_lists), np.int64, num_real)                      # [S]
            qsl[0] = 0
            np.cumsum(q_lens, out=qsl[1:num_real + 1])
            seq_index = np.repeat(np.arange(num_real), q_lens)                                   # [T]
            pos = start_pos[seq_index] + (np.arange(num_real_tokens) - qsl[seq_index])           # [T]
            block_of_token = table[seq_index, pos // self.block_size].astype(np.int64)
            seq_lens[:num_real] = start_pos + q_lens                                             # [S]
            last = qsl[1:num_real + 1] - 1            # the last token of each sequence
            if rows is not None:                      # the last rows[i] tokens of each sequence
                before = np.repeat(np.cumsum(rows) - rows, rows)                                 # [N]
                h["logits_indices"][:num_sampled] = np.repeat(last - rows + 1, rows) + (np.arange(num_sampled) - before)
            else:
                h["logits_indices"][:num_sampled] = last if every_seq_samples else last[sample]
        positions[:num_real_tokens] = pos
        slots[:num_real_tokens] = block_of_token * self.block_size + pos % self.block_size    # [T]
        unwritten = None
        if kv_lens is not None and not decode_only:
            unwritten = np.arange(num_real_tokens) - qsl[seq_index] >= kv_lens[seq_index]
            slots[:num_real_tokens][unwritten] = -1
        if self.num_groups > 1:
            self._fill_groups(h, request_ids, num_seqs, seq_index, pos, unwritten, (num_tokens, num_seqs, width))
        if num_extra:
            h["logits_indices"][num_sampled:] = extra_logits_rows
        if lora_slots is not None:   # each token takes its sequence's adapter slot (any step: rows move)
            h["lora_slots"][:num_real_tokens] = lora_slots if decode_only else lora_slots[seq_index]
            h["lora_slots"][num_real_tokens:] = -1
        if num_seqs > num_real and not steady:   # padding rows: harmless decodes of the null block
            input_ids[num_real_tokens:] = 0
            positions[num_real_tokens:] = 0
            slots[num_real_tokens:] = -1
            qsl[num_real + 1:] = num_real_tokens + np.arange(1, num_seqs - num_real + 1)
            seq_lens[num_real:] = 1

        self._upload(layout)
        t = self._tensors = self.tensors(layout, num_real)
        t.fill_in_order = self._filled_in_order = fill_in_order
        return t

    def _prepare_steady(self, scheduled, pad_to: int | None, width: int | None, prev_rows) -> StepTensors | None:
        """`prepare` for a small steady decode batch, or None when `scheduled` is not one: the same
        requests as this buffer's previous step, which was a decode step with every token on the
        device in the order of its sample (`_filled_in_order`), one placeholder token each again,
        in the same layout, one KV group. Everything but positions, slots, lengths and the rows of tables that
        grew still holds that step's values (`prepare`'s steady case), and those few are written
        element by element: a numpy call on a few rows costs more than the Python it replaces
        (~20 calls: most of a batch-1 host step, `bench/host_step.py`)."""
        signature = self._signature
        if signature is None or not signature[2] or len(scheduled) != signature[1] \
                or not isinstance(prev_rows, PrevSample) or isinstance(scheduled, DecodeSeqs):
            return None
        layout, num_real, _ = signature
        request_ids, token_lists, starts, block_lists, samples = zip(*scheduled)
        if token_lists.count(_ONE_PLACEHOLDER) != num_real or not all(samples) or list(request_ids) != prev_rows.ids \
                or (num_real if pad_to is None else pad_to) != layout.num_seqs or layout.lora or layout.groups > 1 \
                or (max(max(map(len, block_lists)), 1) if width is None else width) != layout.width:
            return None
        bs = self.block_size
        try:     # a start past its table (not scheduled so): the general path's answer
            slots = [blocks[start // bs] * bs + start % bs for start, blocks in zip(starts, block_lists)]
        except IndexError:
            return None
        self._wait_for_last_copy()
        h = self._host_views(layout)
        positions, seq_lens, slot_mapping, table = h["positions"], h["seq_lens"], h["slot_mapping"], h["block_tables"]
        last_rows = self._table_state[0][1]     # this layout's (`_fill_block_table` ran with it last)
        for i, start, blocks, slot in zip(range(num_real), starts, block_lists, slots):
            positions[i] = start
            seq_lens[i] = start + 1
            slot_mapping[i] = slot
            if blocks is not last_rows[i]:      # the table grew (a new tuple from the scheduler)
                last_rows[i] = blocks
                row = table[i]
                row[:len(blocks)] = blocks
                row[len(blocks):] = 0
        self._upload(layout)
        return self._tensors     # the previous step's: the same views, rows and order

    def _upload(self, layout: Layout) -> None:
        """The staged step to the device (one non-blocking copy; the next prepare waits for it)."""
        if not self.on_cpu:
            self.device_buf[:layout.nbytes].copy_(self.host[:layout.nbytes], non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))

    def _fill_groups(self, h: dict[str, np.ndarray], request_ids, num_seqs: int, seq_index: np.ndarray,
                     pos: np.ndarray, unwritten: np.ndarray | None, key: tuple) -> None:
        """KV groups 1..: each group's tables (`group_tables`) and the slots its layers write, as
        `prepare` does for group 0; padding rows and unwritten tokens get slot -1."""
        per_seq = list(map(self.group_tables.get, request_ids, itertools.repeat(self._no_group_tables)))
        num_real_tokens, block_size = len(pos), self.block_size
        col, offset = pos // block_size, pos % block_size
        for g in range(self.num_groups - 1):
            table, slots = h["group_tables"][g], h["group_slots"][g]
            self._fill_block_table(table, [tables[g] for tables in per_seq], num_seqs, key, g + 1)
            slots[:num_real_tokens] = table[seq_index, col].astype(np.int64) * block_size + offset
            if unwritten is not None:
                slots[:num_real_tokens][unwritten] = -1
            slots[num_real_tokens:] = -1

    def _fill_block_table(self, table: np.ndarray, block_lists, num_seqs: int, key: tuple, which: int = 0) -> None:
        """table [S, width]: each sequence's blocks left-aligned and zero after; padding rows zero.

        Incremental: a row whose block tuple is the very object this buffer's previous step of the
        same shape wrote there still holds it (the scheduler hands out a request's table as one
        tuple until the request gains a block), so a steady decode batch rewrites only the rows
        that grew. Any other step, or a new buffer, rewrites the whole table."""
        rows = list(block_lists)
        rows += [None] * (num_seqs - len(rows))          # padding rows
        last_key, last = self._table_state.get(which, (None, None))
        if last_key != key:
            last = None
        self._table_state[which] = (key, rows)
        changed = None if last is None else list(itertools.compress(itertools.count(), map(operator.is_not, rows, last)))
        if changed is None or 4 * len(changed) > len(rows):
            table.fill(0)
            n_blocks = np.fromiter(map(len, block_lists), np.int64, len(block_lists))
            flat = np.fromiter(itertools.chain.from_iterable(block_lists), np.int32, int(n_blocks.sum()))
            width = table.shape[1]
            table[:len(block_lists)][np.arange(width) < n_blocks[:, None]] = flat  # row-major = concat order
            return
        for i in changed:
            blocks, row = rows[i], table[i]
            if blocks is None:
                row[:] = 0
            else:
                row[:len(blocks)] = blocks
                row[len(blocks):] = 0

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the device buffer, grown if needed: where a tensor-parallel rank
        receives rank 0's staged step (`engine.tp.comm`)."""
        if nbytes > self.capacity:
            self._allocate(2 * nbytes)
        self._table_state, self._signature = {}, None      # someone else writes the buffer now
        return self.device_buf[:nbytes]

    def tensors(self, layout: Layout, num_seqs: int | None = None) -> StepTensors:
        """The step tensors over the device buffer as it holds `layout` now."""
        dev, meta = self._device_views(layout)
        num_real = layout.num_seqs if num_seqs is None else num_seqs
        return StepTensors(dev["input_ids"], dev["positions"], meta, dev["logits_indices"],
                           dev["fill_dst"], dev["fill_src"], num_real, layout)

    def _wait_for_last_copy(self) -> None:
        # The host buffer is about to be overwritten: the previous step's copy must have read it.
        if self._copied is not None:
            self._copied.synchronize()


_TORCH = {np.int64: torch.int64, np.int32: torch.int32}
_ONE_PLACEHOLDER = (PLACEHOLDER_TOKEN_ID,)     # a decode's tokens while its input is on the device


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    """`np.arange(n)` (int64, read-only: shared), made once per size."""
    rows = np.arange(n)
    rows.flags.writeable = False
    return rows


@functools.lru_cache(maxsize=64)
def _placeholders(n: int) -> np.ndarray:
    """[n] int64 of PLACEHOLDER_TOKEN_ID (read-only: shared): a columns batch's ids."""
    ids = np.full(n, PLACEHOLDER_TOKEN_ID, np.int64)
    ids.flags.writeable = False
    return ids
