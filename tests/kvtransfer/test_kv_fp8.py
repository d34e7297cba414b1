"""An fp8 (float8_e4m3fn) KV cache moves as raw bytes: 1 byte per element, dtype checked."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.errors import LayoutError
from kvtransfer.layout import KVLayout, dtype_from_name
from kvtransfer.packing import checksum, plan_runs, run_bytes, scatter_blocks, write_run

from kv_helpers import make_kv, same_bytes

FP8_LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)


def test_fp8_layout_is_one_byte_per_element_and_named_on_the_wire():
    assert dtype_from_name("float8_e4m3fn") is torch.float8_e4m3fn
    assert FP8_LAYOUT.bytes_per_block == FP8_LAYOUT.elements_per_block
    info = FP8_LAYOUT.to_model_info("tiny", "f")
    assert info.kv_dtype == "float8_e4m3fn" and KVLayout.from_model_info(info) == FP8_LAYOUT
    bf16 = KVLayout(2, 4, 2, 8, torch.bfloat16)
    assert bf16.mismatch(info) == "kv_dtype: 'bfloat16' here vs 'float8_e4m3fn' there"


def test_fp8_blocks_round_trip_through_bytes_and_scatter():
    src = make_kv(FP8_LAYOUT, num_blocks=12)
    assert KVLayout.from_tensor(src) == FP8_LAYOUT
    block_ids = [3, 4, 5, 9, 2]
    dst_ids = [7, 1, 2, 10, 11]
    dst = torch.zeros_like(src)
    for run in plan_runs(block_ids, 0, len(block_ids), 2):
        data = bytes(run_bytes(src, run))
        ids = dst_ids[run.first_block_index: run.first_block_index + run.num_blocks]
        write_run(dst, ids, data, checksum(data), dtype="float8_e4m3fn")
    for s, d in zip(block_ids, dst_ids):
        assert same_bytes(src[s], dst[d])
    other = torch.zeros_like(src)
    scatter_blocks(other, dst_ids, src[block_ids].contiguous())
    assert same_bytes(other[dst_ids], src[block_ids])


def test_fp8_payload_into_another_dtype_is_refused():
    src = make_kv(FP8_LAYOUT, num_blocks=4)
    data = bytes(src[1].reshape(-1).view(torch.uint8).numpy())
    with pytest.raises(LayoutError, match="does not match the KV cache dtype"):
        write_run(make_kv(KVLayout(2, 4, 2, 8, torch.bfloat16), num_blocks=4), [1], data, None,
                  dtype="float8_e4m3fn")
