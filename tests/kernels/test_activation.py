"""Fused SiLU * mul against its torch reference (``F.silu(gate) * up``) in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.activation_ref import silu_and_mul_ref


def _input(num_tokens: int, intermediate: int, dtype: torch.dtype, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 1000 + intermediate)
    return (3 * torch.randn((num_tokens, 2 * intermediate), generator=gen)).to(dtype).to(device)


def test_reference_is_the_unfused_mlp_activation() -> None:
    x = _input(5, 24, torch.float16, "cpu")
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_ref(x), F.silu(gate) * up)


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 1), (3, 37), (7, 130), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(triton_backend, num_tokens: int, intermediate: int, dtype: torch.dtype) -> None:
    # Odd widths mask the tail of the last column block; 1500 spans two blocks of 1024.
    x = _input(num_tokens, intermediate, dtype, triton_backend)
    out = kernels.silu_and_mul(x)
    want = silu_and_mul_ref(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    # fp32: exp differs by an ulp or two between implementations; fp16: the same two roundings as torch,
    # so at most one fp16 ulp where exp's last bit flips a rounding.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(out, want, **tol)


def test_triton_strided_rows_and_empty(triton_backend) -> None:
    # A view with padded rows (row stride > 2 * I), as a slice of a wider projection output would be.
    base = _input(4, 40, torch.float32, triton_backend)
    x = base[:, :60]  # [4, 60]: gate = cols 0..29, up = cols 30..59; row stride 80
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)
    assert kernels.silu_and_mul(base[:0]).shape == (0, 40)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="must be \\[num_tokens"):
        kernels.silu_and_mul(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="must be even"):
        kernels.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="dtype"):
        kernels.silu_and_mul(torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 1), (3, 37), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_triton_matches_reference(triton_backend, num_tokens: int, intermediate: int,
                                            dtype: torch.dtype) -> None:
    from kernels.activation_ref import gelu_tanh_and_mul_ref

    x = _input(num_tokens, intermediate, dtype, triton_backend)
    gate, up = x.chunk(2, dim=-1)
    want = gelu_tanh_and_mul_ref(x)
    assert torch.equal(want, F.gelu(gate, approximate="tanh") * up)
    out = kernels.gelu_tanh_and_mul(x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(out, want, **tol)
