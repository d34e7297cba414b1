"""KV cache write: Triton and torch backends scatter tokens into an engine-layout cache view."""

from __future__ import annotations

import pytest
import torch

import kernels


def _engine_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
    kv = torch.zeros((num_blocks, 2, 2, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    return kv, kv[:, 1, 0], kv[:, 1, 1]  # layer 1's key and value views


def _expected(kv, key, value, slots, block_size):
    want = kv.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // block_size, 1, 0, slot % block_size] = key[t]
            want[slot // block_size, 1, 1, slot % block_size] = value[t]
    return want


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("block_size, kv_heads, head_dim, dtype",
                         [(1, 2, 32, torch.float32), (16, 3, 80, torch.float16), (32, 1, 64, torch.float32)])
def test_write_kv_scatters_and_skips_padding(request, backend, block_size, kv_heads, head_dim, dtype):
    device = request.getfixturevalue(f"{backend}_backend") if backend == "triton" else torch.device("cpu")
    if backend == "torch":
        request.getfixturevalue("torch_backend")
    kv, key_cache, value_cache = _engine_cache(9, block_size, kv_heads, head_dim, dtype, device)
    num_tokens = 7
    key = torch.randn((num_tokens, kv_heads, head_dim), device=device).to(dtype)
    value = torch.randn((num_tokens, kv_heads, head_dim), device=device).to(dtype)
    slots = torch.randperm(8 * block_size)[:num_tokens] + block_size  # never the null block 0
    slots[2] = -1
    slots = slots.to(device)
    want = _expected(kv, key, value, slots, block_size)
    kernels.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(kv, want)


def test_write_kv_beyond_int32_offsets(triton_backend) -> None:
    # Per-block stride 2*2*16*1*32 = 2048 elements; slot's block id * 2048 > 2**31.
    block_size, first = 16, 2**20 + 64
    kv = torch.empty((first + 4, 2, 2, block_size, 1, 32), dtype=torch.float16, device=triton_backend)
    kv[first:].zero_()  # touch only the blocks in use
    key = torch.randn((3, 1, 32), device=triton_backend).half()
    value = torch.randn((3, 1, 32), device=triton_backend).half()
    slots = torch.tensor([first * block_size + 5, -1, (first + 3) * block_size + 15], device=triton_backend)
    kernels.write_kv(key, value, kv[:, 1, 0], kv[:, 1, 1], slots)
    want = torch.zeros_like(kv[first:])
    want[0, 1, 0, 5], want[0, 1, 1, 5] = key[0], value[0]
    want[3, 1, 0, 15], want[3, 1, 1, 15] = key[2], value[2]
    assert torch.equal(kv[first:], want)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(slot_mapping=torch.zeros(4, dtype=torch.int32)), "slot_mapping must be int64"),
        (dict(value=torch.zeros(4, 1, 16)), "key/value"),
        (dict(key_cache=torch.zeros(3, 8, 2, 8), value_cache=torch.zeros(3, 8, 2, 8)), "cache heads/head_dim"),
    ],
)
def test_write_kv_rejects_bad_inputs(kwargs, message) -> None:
    args = dict(key=torch.zeros(4, 2, 16), value=torch.zeros(4, 2, 16), key_cache=torch.zeros(3, 8, 2, 16),
                value_cache=torch.zeros(3, 8, 2, 16), slot_mapping=torch.zeros(4, dtype=torch.int64))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        kernels.write_kv(**args)


def test_write_kv_reference_handles_caches_that_are_not_dense_per_token() -> None:
    # A head-major view ([..., block_size, heads, D] over [..., heads, block_size, D] memory) has no
    # dense per-token row: the reference falls back to advanced indexing and still scatters right.
    from kernels.kv_write_ref import write_kv_ref

    block_size, heads, head_dim = 4, 2, 8
    base = torch.zeros((5, 2, heads, block_size, head_dim))
    key_cache, value_cache = base[:, 0].transpose(1, 2), base[:, 1].transpose(1, 2)
    key, value = torch.randn(3, heads, head_dim), torch.randn(3, heads, head_dim)
    slots = torch.tensor([block_size + 1, -1, 4 * block_size + 3])
    write_kv_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[4, 3], value[2])
    assert int((base != 0).sum()) == 2 * 2 * heads * head_dim  # nothing else was written
