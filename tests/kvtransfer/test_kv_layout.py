from __future__ import annotations

import pytest
import torch

from kvtransfer.errors import LayoutError
from kvtransfer.layout import KVLayout, check_compatible

from kv_helpers import TINY, make_kv

LLAMA8B = KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def test_bytes_per_block():
    assert TINY.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4
    assert LLAMA8B.bytes_per_block == 2 * 1024 * 1024  # 2 MiB per 16-token block
    assert LLAMA8B.num_blocks_for(2048) == 128 and LLAMA8B.num_blocks_for(2049) == 129


def test_from_tensor_round_trip():
    kv = make_kv()
    assert KVLayout.from_tensor(kv) == TINY
    with pytest.raises(LayoutError, match="must be"):
        KVLayout.from_tensor(kv[:, :, 0])
    with pytest.raises(LayoutError, match="contiguous"):
        KVLayout.from_tensor(kv.transpose(3, 4))


def test_invalid_fields():
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout(2, 0, 2, 8, torch.float32)
    with pytest.raises(LayoutError, match="dtype"):
        KVLayout(2, 4, 2, 8, torch.int8)


def test_model_info_round_trip_and_mismatch():
    info = LLAMA8B.to_model_info("llama", "abc", max_model_len=8192)
    assert info.kv_dtype == "bfloat16" and info.block_size == 16
    assert KVLayout.from_model_info(info) == LLAMA8B
    assert LLAMA8B.mismatch(info) is None
    assert "head_dim: 8 here vs 128 there" in TINY.mismatch(info)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("model_fingerprint", "other", "model_fingerprint: 'abc' (llama) here vs 'other'"),
        ("model_fingerprint", "", "model_fingerprint is empty on the remote side"),
        ("block_size", 32, "block_size: 16 here vs 32 there"),
        ("kv_dtype", "float16", "kv_dtype: 'bfloat16' here vs 'float16' there"),
        ("num_layers", 16, "num_layers"),
        ("num_kv_heads", 4, "num_kv_heads"),
        ("head_dim", 64, "head_dim"),
    ],
)
def test_check_compatible_names_the_difference(field, value, expected):
    local = LLAMA8B.to_model_info("llama", "abc")
    remote = LLAMA8B.to_model_info("llama", "abc")
    assert check_compatible(local, remote) is None
    setattr(remote, field, value)
    problem = check_compatible(local, remote)
    assert problem is not None and expected in problem


def test_check_compatible_ignores_labels():
    local = LLAMA8B.to_model_info("llama", "abc", max_model_len=4096)
    remote = LLAMA8B.to_model_info("served-name", "abc", max_model_len=8192)
    assert check_compatible(local, remote) is None


def test_check_compatible_compares_the_layer_windows():
    # Gemma-like interleaving vs the same model served as if every layer were global (an older
    # pod): the blocks mean the same bytes, but not the same attention, nor the same freeing.
    windows = tuple(4096 if i % 6 != 5 else 0 for i in range(LLAMA8B.num_layers))
    local = LLAMA8B.to_model_info("gemma", "abc", layer_windows=windows)
    assert list(local.layer_windows) == list(windows)
    assert check_compatible(local, LLAMA8B.to_model_info("gemma", "abc", layer_windows=windows)) is None
    problem = check_compatible(local, LLAMA8B.to_model_info("gemma", "abc"))
    assert problem is not None and "layer_windows: [4096, 4096" in problem and "vs none there" in problem
    with pytest.raises(LayoutError, match="layer_windows"):
        LLAMA8B.to_model_info("gemma", "abc", layer_windows=(1, 2))


def test_check_compatible_compares_what_a_pull_sends():
    # Every layer windowed: a pod that sends only the last window's blocks cannot pair with one
    # from before kv_transfer_window (it sends, or expects, every block).
    windows = (4096,) * LLAMA8B.num_layers
    new = LLAMA8B.to_model_info("mistral", "abc", layer_windows=windows, kv_transfer_window=4096)
    assert check_compatible(new, LLAMA8B.to_model_info("mistral", "abc", layer_windows=windows,
                                                       kv_transfer_window=4096)) is None
    problem = check_compatible(new, LLAMA8B.to_model_info("mistral", "abc", layer_windows=windows))
    assert problem is not None and "kv_transfer_window: 4096 here vs 0 there" in problem
