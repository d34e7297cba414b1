"""Rotary embedding kernels against Hugging Face apply_rotary_pos_emb and the torch reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.rope_ref import apply_rope_ref


def _cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]


def _case(num_tokens=6, heads=4, kv_heads=2, head_dim=32, rotary_dim=None, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype).to(device)
    k = torch.randn((num_tokens, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
    return q, k, positions, _cos_sin_cache(64, rotary_dim or head_dim).to(device)


def test_reference_matches_hf_apply_rotary_pos_emb() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, positions, cache = _case()
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [num_tokens, head_dim]
    # HF wants [batch, heads, seq, head_dim]; unsqueeze_dim=1 broadcasts cos over heads.
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    out_q, out_k = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("head_dim, rotary_dim, dtype", [(32, None, torch.float32), (80, None, torch.float16),
                                                         (64, 32, torch.float32)])
def test_triton_rope_matches_reference(triton_backend, head_dim, rotary_dim, dtype) -> None:
    q, k, positions, cache = _case(head_dim=head_dim, rotary_dim=rotary_dim, dtype=dtype, device=triton_backend)
    out_q, out_k = kernels.apply_rope(q, k, positions, cache)
    want_q, want_k = apply_rope_ref(q, k, positions, cache)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    assert out_q.dtype == dtype and out_k.shape == k.shape
    torch.testing.assert_close(out_q, want_q, **tol)
    torch.testing.assert_close(out_k, want_k, **tol)


def test_triton_rope_strided_views(triton_backend) -> None:
    # q and k as views into one fused qkv projection output, as a model produces them.
    qkv = torch.randn(5, 8, 32, device=triton_backend)
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.arange(5, device=triton_backend)
    cache = _cos_sin_cache(16, 32).to(triton_backend)
    out_q, out_k = kernels.apply_rope(q, k, positions, cache)
    want_q, want_k = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(out_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, want_k, atol=1e-6, rtol=1e-6)


def test_rope_rejects_bad_inputs() -> None:
    q, k, positions, cache = _case()
    with pytest.raises(ValueError, match="positions must be int64"):
        kernels.apply_rope(q, k, positions.int(), cache)
    with pytest.raises(ValueError, match="rotary_dim"):
        kernels.apply_rope(q, k, positions, _cos_sin_cache(64, 66))
