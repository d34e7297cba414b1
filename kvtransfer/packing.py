"""Blocks <-> bytes: coalescing runs, zero-copy views, checksums, scattering into blocks.

A request's KV is a list of block ids into the engine's one KV tensor
`kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`. Ids are often, but not
always, consecutive; every run of consecutive ids is one contiguous byte range `kv[a:b]`, so a
run travels as one message without any gather. Runs are split so that no message carries more
than `max_chunk_bytes` of payload.

On the receiving side the destination ids are another pod's ids, consecutive or not; the bytes of
one message are copied into each consecutive stretch of destination blocks with one copy.

Checksums are `zlib.crc32` (measured ~2 GB/s on one core for 4 MiB; `binascii.crc32` is the same
code, `zlib.adler32` is faster but not a crc). zlib releases the GIL on large buffers, so the
checksum of one message can overlap the event loop's other work when run in a thread.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.errors import ChecksumError, LayoutError
from kvtransfer.grpc_options import DEFAULT_MAX_CHUNK_BYTES, MAX_CHUNK_BYTES
from kvtransfer.layout import KVLayout, dtype_from_name

__all__ = [
    "ChecksumError", "LayoutError", "Run", "checksum", "consecutive_spans", "plan_runs",
    "resolve_max_chunk_bytes", "run_bytes", "run_tensor", "scatter_blocks", "write_run",
]


@dataclass(frozen=True)
class Run:
    """Blocks `block_ids[first_block_index : first_block_index + num_blocks]`, whose physical ids
    are `first_block_id, first_block_id + 1, ...` (one contiguous byte range of the KV tensor)."""

    first_block_index: int
    num_blocks: int
    first_block_id: int


def checksum(data: bytes | memoryview) -> int:
    """crc32 of a message's payload (unsigned 32-bit, as `KVChunk.crc32`)."""
    return zlib.crc32(data)


def resolve_max_chunk_bytes(requested: int, layout: KVLayout) -> int:
    """The payload cap for one stream: `requested` (0 = default), validated against the layout.

    A message holds whole blocks (KVChunk has no byte offset), so the cap must fit one block; the
    default grows to one block for very large blocks, an explicit value that is too small is an
    error. It must also stay under the gRPC message limit (`grpc_options.MAX_CHUNK_BYTES`).
    """
    if requested < 0:
        raise LayoutError(f"max_chunk_bytes must be >= 0, got {requested}")
    if requested == 0:
        return max(DEFAULT_MAX_CHUNK_BYTES, layout.bytes_per_block)
    if requested < layout.bytes_per_block:
        raise LayoutError(
            f"max_chunk_bytes={requested} is smaller than one KV block ({layout.bytes_per_block} bytes)"
        )
    if requested > MAX_CHUNK_BYTES:
        raise LayoutError(f"max_chunk_bytes={requested} exceeds the gRPC payload cap {MAX_CHUNK_BYTES}")
    return requested


def plan_runs(block_ids: Sequence[int], start_index: int, end_index: int,
              max_blocks_per_run: int) -> list[Run]:
    """Split `block_ids[start_index:end_index]` into runs of consecutive ids, each at most
    `max_blocks_per_run` blocks, in order."""
    if max_blocks_per_run <= 0:
        raise LayoutError(f"max_blocks_per_run must be positive, got {max_blocks_per_run}")
    runs: list[Run] = []
    index = start_index
    while index < end_index:
        first_id = block_ids[index]
        count = 1
        while (index + count < end_index and count < max_blocks_per_run
               and block_ids[index + count] == first_id + count):
            count += 1
        runs.append(Run(index, count, first_id))
        index += count
    return runs


def consecutive_spans(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(offset, first_id, count)` for each stretch of consecutive ids in `block_ids`."""
    return [(run.first_block_index, run.first_block_id, run.num_blocks)
            for run in plan_runs(block_ids, 0, len(block_ids), len(block_ids) or 1)]


def run_tensor(kv: torch.Tensor, run: Run) -> torch.Tensor:
    """The run's blocks as a view: `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`."""
    return kv[run.first_block_id: run.first_block_id + run.num_blocks]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy; works for bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8)


def run_bytes(kv: torch.Tensor, run: Run, staging: torch.Tensor | None = None) -> memoryview:
    """The run's raw bytes, without a copy when `kv` is on the CPU.

    For a CUDA cache the bytes are copied into `staging` (a pinned uint8 host buffer of at least
    the run's size, reused across messages) and the view points into it: it is valid until the
    next call with the same buffer. The caller must not let the engine reuse the blocks while the
    view is alive (the held-KV lease guarantees that on the prefill pod).
    """
    flat = _flat_bytes(run_tensor(kv, run))  # [num_blocks * bytes_per_block]
    if flat.device.type != "cpu":
        if staging is None or staging.numel() < flat.numel():
            raise LayoutError("a CUDA KV cache needs a pinned staging buffer of at least one run")
        host = staging[: flat.numel()]
        host.copy_(flat)  # synchronous device -> pinned host copy
        flat = host
    return memoryview(flat.numpy())


def write_run(kv: torch.Tensor, dst_block_ids: Sequence[int], data: bytes | memoryview,
              crc32: int | None, dtype: torch.dtype | str | None = None,
              staging: torch.Tensor | None = None) -> None:
    """Verify `data` against `crc32` and copy it into blocks `dst_block_ids` of `kv`.

    `data` holds `len(dst_block_ids)` blocks back to back; the ids need not be consecutive. `dtype`
    (the sender's KV dtype, torch or wire name) is checked against `kv` when given. `crc32=None`
    skips the check (for payloads that did not cross a byte stream). For a CUDA cache, `staging`
    is an optional pinned host buffer used for the host -> device copies.
    Raises `LayoutError` (sizes, ids, dtype) or `ChecksumError` and then leaves `kv` untouched.
    """
    layout = KVLayout.from_tensor(kv)
    if dtype is not None:
        sender = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        if sender != kv.dtype:
            raise LayoutError(f"payload dtype {sender} does not match the KV cache dtype {kv.dtype}")
    expected = len(dst_block_ids) * layout.bytes_per_block
    if len(data) != expected:
        raise LayoutError(
            f"payload has {len(data)} bytes, expected {expected} for {len(dst_block_ids)} blocks "
            f"of {layout.bytes_per_block} bytes"
        )
    _check_block_ids(kv, dst_block_ids)
    if crc32 is not None and (actual := checksum(data)) != crc32:
        raise ChecksumError(f"crc32 mismatch: payload has {actual:#010x}, message says {crc32:#010x}")
    source = np.frombuffer(data, dtype=np.uint8)  # read-only view of the message bytes
    for offset, first_id, count in consecutive_spans(dst_block_ids):
        part = source[offset * layout.bytes_per_block: (offset + count) * layout.bytes_per_block]
        dst = _flat_bytes(kv[first_id: first_id + count])
        if dst.device.type == "cpu":
            np.copyto(dst.numpy(), part)
        else:
            if staging is None or staging.numel() < part.size:
                staging = torch.empty(part.size, dtype=torch.uint8, pin_memory=True)
            host = staging[: part.size]
            np.copyto(host.numpy(), part)
            dst.copy_(host)  # synchronous: `staging` may be reused right after


def scatter_blocks(kv: torch.Tensor, dst_block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """Copy a contiguous tensor holding `len(dst_block_ids)` blocks (any dtype view, e.g. the flat
    uint8 payload of the collective transport) into the destination blocks, same device or not."""
    layout = KVLayout.from_tensor(kv)
    flat = _flat_bytes(blocks.contiguous())
    if flat.numel() != len(dst_block_ids) * layout.bytes_per_block:
        raise LayoutError(
            f"payload has {flat.numel()} bytes, expected {len(dst_block_ids) * layout.bytes_per_block}"
        )
    _check_block_ids(kv, dst_block_ids)
    for offset, first_id, count in consecutive_spans(dst_block_ids):
        part = flat[offset * layout.bytes_per_block: (offset + count) * layout.bytes_per_block]
        _flat_bytes(kv[first_id: first_id + count]).copy_(part)


def _check_block_ids(kv: torch.Tensor, block_ids: Sequence[int]) -> None:
    # Block 0 is the engine's null block: writing into it would corrupt every padded lookup.
    bad = [b for b in block_ids if not 0 < b < kv.shape[0]]
    if bad:
        raise LayoutError(f"destination block ids {bad[:8]} are outside 1..{kv.shape[0] - 1}")
