"""Fused MoE experts: the slot alignment, the torch reference against a dense per-expert loop, and
the Triton grouped GEMM (in the interpreter on CPU) against the reference.

Routings cover the skewed cases a real router produces: every token on one expert, experts with
no tokens, top-k 1 and top-k > 2, an odd number of experts, a token count that is not a multiple
of the block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.moe_align import max_padded_slots, moe_align_block_size
from kernels.moe_ref import fused_moe_ref


def _routing(kind: str, num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int64 distinct experts per token."""
    if kind == "one_expert" and top_k == 1:
        return torch.zeros((num_tokens, 1), dtype=torch.int64)
    if kind == "one_expert":              # every token on expert E-1 (plus the next ones for k > 1)
        base = torch.arange(top_k) + num_experts - top_k
        return base.flip(0).repeat(num_tokens, 1)
    if kind == "some_empty":              # only the even experts get tokens
        pool = torch.arange(0, num_experts, 2)
        if len(pool) < top_k:
            pool = torch.arange(num_experts)
        return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)])
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


def _case(num_tokens, hidden, inter, num_experts, top_k, kind, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, hidden), generator=gen)
    w13 = torch.randn((num_experts, 2 * inter, hidden), generator=gen) / hidden ** 0.5
    w2 = torch.randn((num_experts, hidden, inter), generator=gen) / inter ** 0.5
    ids = _routing(kind, num_tokens, top_k, num_experts, gen)
    weights = torch.rand((num_tokens, top_k), generator=gen)
    weights /= weights.sum(-1, keepdim=True)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), weights.to(device),
            ids.to(device))


def _dense_loop(x, w13, w2, weights, ids):
    """Every expert over every token, masked: the plainest statement of the math (fp32)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x.float(), w13[e].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e].float())
        out += y * (weights * (ids == e)).sum(-1, keepdim=True)
    return out


ROUTINGS = ["random", "one_expert", "some_empty"]


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(1, 8, 2, 16), (13, 3, 1, 4), (40, 5, 3, 16)])
def test_align_groups_slots_by_expert_in_whole_blocks(kind, num_tokens, num_experts, top_k, block_m):
    ids = _routing(kind, num_tokens, top_k, num_experts, torch.Generator().manual_seed(1))
    slots, block_experts, num_padded = moe_align_block_size(ids, block_m, num_experts)
    n = num_tokens * top_k
    assert slots.shape == (max_padded_slots(n, num_experts, block_m),)       # fixed by the shapes alone
    assert block_experts.shape == (slots.shape[0] // block_m,)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    used = slots[:int(num_padded)]
    real = used[used < n]
    assert sorted(real.tolist()) == list(range(n))                          # every slot once
    assert (slots[int(num_padded):] == n).all()                             # the tail is padding
    flat = ids.reshape(-1)
    for b in range(int(num_padded) // block_m):
        block = used[b * block_m:(b + 1) * block_m]
        block = block[block < n].long()
        assert len(block) > 0                                               # no block of padding only
        assert (flat[block] == block_experts[b]).all()                      # one expert per block
        assert block.tolist() == sorted(block.tolist())                     # stable: token order kept


def test_align_reads_nothing_back_from_the_device(monkeypatch):
    from tests.engine.test_sampler_no_sync import count_reads

    ids = _routing("some_empty", 9, 2, 6, torch.Generator().manual_seed(2))
    with count_reads(monkeypatch, also_numpy=True) as hits:
        moe_align_block_size(ids, 16, 6)
    assert hits == []


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 1), (7, 3, 2), (20, 8, 3)])
def test_reference_equals_the_dense_loop(kind, num_tokens, num_experts, top_k):
    x, w13, w2, weights, ids = _case(num_tokens, 24, 10, num_experts, top_k, kind, torch.float32, "cpu")
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), _dense_loop(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_reference_runs_only_the_experts_that_got_tokens():
    x, w13, w2, weights, ids = _case(6, 16, 8, 8, 2, "some_empty", torch.float32, "cpu")
    called = []

    def linear(inp, weight):
        called.append(weight.shape)
        return F.linear(inp, weight)

    fused_moe_ref(x, w13, w2, weights, ids, linear=linear)
    assert len(called) == 2 * len(set(ids.reshape(-1).tolist()))


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 32, 16, 8, 2),      # decode: two experts of eight, one row each
    (5, 48, 40, 3, 1),      # odd experts, top-1, widths that mask the last tile
    (37, 32, 24, 5, 3),     # top-3, more slots than one block per expert
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(triton_backend, kind, num_tokens, hidden, inter, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, kind, dtype, triton_backend)
    out = kernels.fused_moe(x, w13, w2, weights, ids.to(torch.int32))
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    # fp32: only the summation order of the dot products differs. fp16: the same roundings, but an
    # accumulation order that moves a rounded intermediate by one fp16 ulp now and then, which the
    # down projection carries through: a few ulps of the output's scale (|out| ~ 1).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(out, want, **tol)


def test_triton_fp8_weights_match_the_dequantized_reference(triton_backend):
    x, w13, w2, weights, ids = _case(9, 32, 16, 4, 2, "random", torch.float32, triton_backend)
    s13 = w13.abs().amax(-1) / 448.0
    s2 = w2.abs().amax(-1) / 448.0
    q13 = (w13 / s13[..., None]).to(torch.float8_e4m3fn)
    q2 = (w2 / s2[..., None]).to(torch.float8_e4m3fn)
    out = kernels.fused_moe(x, q13, q2, weights, ids, s13, s2)
    want = fused_moe_ref(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # and the fp8 model is close to the float one (e4m3: ~3% per weight)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=0.1, rtol=0.1)


def test_triton_empty_batch(triton_backend):
    x, w13, w2, weights, ids = _case(1, 16, 16, 2, 1, "random", torch.float32, triton_backend)
    assert kernels.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)


def test_rejects_bad_inputs():
    x, w13, w2, weights, ids = _case(3, 16, 8, 4, 2, "random", torch.float32, "cpu")
    with pytest.raises(ValueError, match="w2 must be"):
        kernels.fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="topk_ids must be"):
        kernels.fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        kernels.fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="must both be x's dtype"):
        kernels.fused_moe(x, w13.half(), w2.half(), weights, ids)
    with pytest.raises(ValueError, match="fp8 experts need"):
        kernels.fused_moe(x, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), weights, ids)
