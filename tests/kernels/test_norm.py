"""RMSNorm kernels against Hugging Face LlamaRMSNorm and the torch reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref

EPS = 1e-6


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(x.shape[-1], eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
    return norm.to(weight.dtype)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_equals_hf_llama_rms_norm(dtype) -> None:
    x = torch.randn(3, 5, 96).to(dtype)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    assert torch.equal(rms_norm_ref(x, weight, EPS), _hf_rms_norm(x, weight))
    residual = torch.randn(3, 5, 96).to(dtype)
    out, summed = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(summed, residual + x) and torch.equal(out, _hf_rms_norm(residual + x, weight))


# Tolerances: the kernel reduces in a different order than torch, so the fp32 variance differs
# in the last bits; after rounding to half precision at most one ulp apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("hidden, dtype", [(64, torch.float32), (96, torch.float16), (1, torch.float32)])
def test_triton_rms_norm_matches_reference(triton_backend, hidden, dtype) -> None:
    x = torch.randn(2, 7, hidden, device=triton_backend).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=triton_backend)).to(dtype)
    out = kernels.rms_norm(x, weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_fused_add_rms_norm_matches_reference(triton_backend, dtype) -> None:
    x = torch.randn(9, 80, device=triton_backend).to(dtype)
    residual = torch.randn(9, 80, device=triton_backend).to(dtype)
    weight = torch.randn(80, device=triton_backend).to(dtype)
    out, summed = kernels.fused_add_rms_norm(x, residual, weight, EPS)
    want_out, want_sum = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(summed, want_sum)  # the residual sum is one rounding: exact
    torch.testing.assert_close(out, want_out, **TOL[dtype])


def test_triton_rms_norm_strided_rows_and_fp32_weight(triton_backend) -> None:
    x = torch.randn(6, 128, device=triton_backend).half()[::2, :64]  # non-contiguous rows
    weight = torch.randn(64, device=triton_backend)  # fp32 weight promotes the output, as in torch
    out = kernels.rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), atol=1e-5, rtol=1e-5)


def test_rms_norm_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="residual"):
        kernels.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8).half(), torch.ones(8), EPS)
