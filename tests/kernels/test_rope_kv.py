"""Fused RoPE + KV cache write: equals ``apply_rope`` followed by ``write_kv`` of the rotated keys.

Bit for bit in fp32 against the two Triton launches (they share the rotation arithmetic), and
against the two torch references within RoPE's tolerance; the caches, padding rows (slot -1),
GQA, partial rotary, strided q/k/v views of one qkv projection and block ids whose offsets
overflow int32 included.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.kv_write_ref import write_kv_ref
from kernels.rope_kv_ref import rope_and_write_kv_ref
from kernels.rope_ref import apply_rope_ref


def _cos_sin_cache(max_position: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _case(num_tokens, heads, kv_heads, head_dim, block_size, num_blocks, dtype, device, rotary_dim=None,
          first_block=1, seed=0):
    """q/k/v as strided views of one fused qkv output; an engine-layout cache (layer 1 used)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn((num_tokens, heads + 2 * kv_heads, head_dim), generator=gen).to(dtype).to(device)
    q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
    cache = _cos_sin_cache(64, rotary_dim or head_dim).to(device)
    kv = torch.zeros((num_blocks, 2, 2, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    usable = (num_blocks - first_block) * block_size
    slots = first_block * block_size + torch.randperm(usable, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding rows: rotated, never written
    return q, k, v, positions, cache, kv, slots.to(device)


def _two_calls(q, k, v, positions, cache, kv, slots):
    q_rot, k_rot = kernels.apply_rope(q, k, positions, cache)
    kernels.write_kv(k_rot, v, kv[:, 1, 0], kv[:, 1, 1], slots)
    return q_rot, k_rot


def _fused(q, k, v, positions, cache, kv, slots):
    return kernels.rope_and_write_kv(q, k, v, positions, cache, kv[:, 1, 0], kv[:, 1, 1], slots)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, rotary_dim, block_size",
    [(4, 2, 32, None, 16), (8, 1, 64, None, 1), (6, 3, 80, None, 32), (4, 2, 64, 32, 16), (2, 2, 48, 16, 8),
     (3, 1, 37, 20, 4)],
    ids=["gqa2", "mqa-block1", "head80", "partial-rotary", "odd-heads-partial", "odd-head-dim"],
)
def test_fused_equals_two_triton_calls_bit_for_bit_fp32(triton_backend, heads, kv_heads, head_dim, rotary_dim,
                                                         block_size) -> None:
    args = _case(11, heads, kv_heads, head_dim, block_size, 24, torch.float32, triton_backend, rotary_dim)
    q, k, v, positions, cache, kv, slots = args
    kv_two = kv.clone()
    want_q, want_k = _two_calls(q, k, v, positions, cache, kv_two, slots)
    got_q, got_k = _fused(*args)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(kv, kv_two)  # caches identical, including the untouched slots of padding rows
    # ... and the composition of the torch references, within RoPE's fp32 tolerance.
    kv_ref = torch.zeros_like(kv)
    ref_q, ref_k = rope_and_write_kv_ref(q, k, v, positions, cache, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots)
    for got, want in ((got_q, ref_q), (got_k, ref_k), (kv, kv_ref)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_fused_fp16_matches_references(triton_backend, rotary_dim) -> None:
    args = _case(9, 8, 2, 64, 16, 6, torch.float16, triton_backend, rotary_dim, seed=1)
    q, k, v, positions, cache, kv, slots = args
    kv_ref = kv.clone()
    ref_q, ref_k = rope_and_write_kv_ref(q, k, v, positions, cache, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots)
    kv_two = kv.clone()
    two_q, two_k = _two_calls(q, k, v, positions, cache, kv_two, slots)
    got_q, got_k = _fused(*args)
    assert torch.equal(got_q, two_q) and torch.equal(got_k, two_k) and torch.equal(kv, kv_two)
    tol = dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(got_k, ref_k, **tol)
    torch.testing.assert_close(kv, kv_ref, **tol)
    # The cache holds exactly the returned (rounded) rotated keys and the values, nothing else.
    kv_from_out = torch.zeros_like(kv)
    write_kv_ref(got_k, v, kv_from_out[:, 1, 0], kv_from_out[:, 1, 1], slots)
    assert torch.equal(kv, kv_from_out)


def test_fused_block_offsets_beyond_int32(triton_backend) -> None:
    # Per-block stride 2*2*16*1*32 = 2048 elements; blocks past 2**20 put offsets beyond 2**31.
    block_size, first = 16, 2**20 + 64
    num_tokens, heads, kv_heads, head_dim = 3, 2, 1, 32
    kv = torch.empty((first + 4, 2, 2, block_size, kv_heads, head_dim), dtype=torch.float16, device=triton_backend)
    kv[first:].zero_()  # touch only the blocks in use
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((num_tokens, heads, head_dim), generator=gen).half().to(triton_backend)
    k = torch.randn((num_tokens, kv_heads, head_dim), generator=gen).half().to(triton_backend)
    v = torch.randn((num_tokens, kv_heads, head_dim), generator=gen).half().to(triton_backend)
    positions = torch.tensor([3, 9, 27], device=triton_backend)
    cache = _cos_sin_cache(32, head_dim).to(triton_backend)
    slots = torch.tensor([first * block_size + 5, -1, (first + 3) * block_size + 15], device=triton_backend)
    _, k_rot = kernels.rope_and_write_kv(q, k, v, positions, cache, kv[:, 1, 0], kv[:, 1, 1], slots)
    want = torch.zeros_like(kv[first:])
    want[0, 1, 0, 5], want[0, 1, 1, 5] = k_rot[0], v[0]
    want[3, 1, 0, 15], want[3, 1, 1, 15] = k_rot[2], v[2]
    assert torch.equal(kv[first:], want)
    torch.testing.assert_close(k_rot, apply_rope_ref(q, k, positions, cache)[1], atol=1e-3, rtol=1e-3)


def test_torch_backend_is_the_composed_references(torch_backend) -> None:
    args = _case(7, 4, 2, 32, 16, 5, torch.float32, "cpu")
    q, k, v, positions, cache, kv, slots = args
    kv_two = kv.clone()
    want_q, want_k = apply_rope_ref(q, k, positions, cache)
    write_kv_ref(want_k, v, kv_two[:, 1, 0], kv_two[:, 1, 1], slots)
    got_q, got_k = _fused(*args)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(kv, kv_two)


def test_rejects_bad_inputs() -> None:
    q, k, v, positions, cache, kv, slots = _case(4, 4, 2, 32, 16, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="positions must be int64"):
        kernels.rope_and_write_kv(q, k, v, positions.int(), cache, kv[:, 1, 0], kv[:, 1, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        kernels.rope_and_write_kv(q, k, v, positions, cache, kv[:, 1, 0], kv[:, 1, 1], slots.int())
    with pytest.raises(ValueError, match="dtype mismatch"):
        kernels.rope_and_write_kv(q, k, v, positions, cache, kv[:, 1, 0].half(), kv[:, 1, 1].half(), slots)
