from __future__ import annotations

import pytest
import torch

from kvtransfer.errors import ChecksumError, LayoutError
from kvtransfer.grpc_options import DEFAULT_MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES
from kvtransfer.layout import KVLayout
from kvtransfer.packing import (Run, checksum, consecutive_spans, plan_runs,
                                resolve_max_chunk_bytes, run_bytes, scatter_blocks, write_run)

from kv_helpers import TINY, make_kv, same_bytes


def test_plan_runs_coalesces_consecutive_ids():
    ids = [3, 4, 5, 9, 10, 2, 7, 8, 9, 10, 11]
    assert plan_runs(ids, 0, len(ids), 100) == [
        Run(0, 3, 3), Run(3, 2, 9), Run(5, 1, 2), Run(6, 5, 7)]


def test_plan_runs_respects_cap_and_range():
    ids = list(range(1, 11))
    assert plan_runs(ids, 2, 9, 3) == [Run(2, 3, 3), Run(5, 3, 6), Run(8, 1, 9)]
    assert plan_runs(ids, 5, 5, 3) == []


def test_consecutive_spans():
    assert consecutive_spans([5, 6, 1, 2, 3, 9]) == [(0, 5, 2), (2, 1, 3), (5, 9, 1)]
    assert consecutive_spans([]) == []


def test_resolve_max_chunk_bytes():
    big = KVLayout(num_layers=80, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert resolve_max_chunk_bytes(0, TINY) == DEFAULT_MAX_CHUNK_BYTES
    assert resolve_max_chunk_bytes(0, big) == big.bytes_per_block  # one 5 MiB block per message
    assert resolve_max_chunk_bytes(TINY.bytes_per_block, TINY) == TINY.bytes_per_block
    with pytest.raises(LayoutError, match="smaller than one KV block"):
        resolve_max_chunk_bytes(TINY.bytes_per_block - 1, TINY)
    with pytest.raises(LayoutError, match="gRPC payload cap"):
        resolve_max_chunk_bytes(MAX_CHUNK_BYTES + 1, TINY)
    assert MAX_CHUNK_BYTES < MAX_MESSAGE_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_run_bytes_is_a_zero_copy_view(dtype):
    layout = KVLayout(2, 4, 2, 8, dtype)
    kv = make_kv(layout)
    view = run_bytes(kv, Run(0, 3, 5))
    assert len(view) == 3 * layout.bytes_per_block
    assert bytes(view) == kv[5:8].contiguous().view(torch.uint8).numpy().tobytes()
    kv[6].fill_(1.0)  # the view follows the tensor: it shares its memory
    assert bytes(view) == kv[5:8].view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_run_scatters_into_non_consecutive_blocks(dtype):
    layout = KVLayout(2, 4, 2, 8, dtype)
    src, dst = make_kv(layout), torch.zeros((16, *layout.block_shape), dtype=dtype)
    data = bytes(run_bytes(src, Run(0, 4, 2)))  # source blocks 2..5
    write_run(dst, [9, 3, 4, 12], data, checksum(data), dtype=layout.dtype_name)
    for src_id, dst_id in zip([2, 3, 4, 5], [9, 3, 4, 12]):
        assert same_bytes(src[src_id], dst[dst_id])
    assert same_bytes(dst[5], torch.zeros_like(dst[5]))


def test_write_run_refuses_corruption_and_leaves_kv_untouched():
    src, dst = make_kv(), torch.zeros((16, *TINY.block_shape))
    data = bytearray(run_bytes(src, Run(0, 2, 1)))
    crc = checksum(data)
    data[17] ^= 0x40
    with pytest.raises(ChecksumError, match="crc32 mismatch"):
        write_run(dst, [1, 2], bytes(data), crc)
    assert not dst.any()


def test_write_run_validates_sizes_ids_and_dtype():
    src, dst = make_kv(), torch.zeros((16, *TINY.block_shape))
    data = bytes(run_bytes(src, Run(0, 2, 1)))
    with pytest.raises(LayoutError, match="expected 1024 for 1 blocks"):
        write_run(dst, [1], data, None)
    with pytest.raises(LayoutError, match="outside 1..15"):
        write_run(dst, [0, 1], data, None)
    with pytest.raises(LayoutError, match="outside 1..15"):
        write_run(dst, [15, 16], data, None)
    with pytest.raises(LayoutError, match="dtype"):
        write_run(dst, [1, 2], data, None, dtype="bfloat16")


def test_scatter_blocks_from_flat_bytes():
    src, dst = make_kv(), torch.zeros((16, *TINY.block_shape))
    flat = src[3:6].reshape(-1).view(torch.uint8).clone()
    scatter_blocks(dst, [7, 1, 2], flat)
    assert same_bytes(dst[7], src[3]) and same_bytes(dst[2], src[5])
    with pytest.raises(LayoutError, match="payload has"):
        scatter_blocks(dst, [7, 1], flat)
