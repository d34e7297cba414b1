"""Per-row fp8 quantization of activations (`kernels.quantize_fp8_rows`): reference and Triton.

The reference's codes are the rounded quotients ``x / scale``; the Triton kernel computes the same
scales (to fp32 rounding) and, on a GPU, the same codes up to a neighbouring code where its fp32
division differs in the last bit. Triton's interpreter rounds fp32 -> e4m3 without the carry into
the exponent (see test_fp8_kv.py) and misrounds e4m3's subnormals (below 2**-6), so under it only
scales, zero rows and the codes of normal values (equal, or half from the missing carry) are checked.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8_quant_ref import FP8, quantize_fp8_rows_ref


def _rows(device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((6, 1500), generator=gen) * torch.tensor([1, 10, 0.01, 3, 1, 1])[:, None]
    x[3] = 0.0                       # an all-zero row: zeros, a tiny positive scale
    x[4, 7] = 1e4                    # one outlier sets its row's scale only
    return x.to(device)


def test_reference_scales_each_row_to_the_e4m3_range(torch_backend):
    x = _rows("cpu")
    q, scale = kernels.quantize_fp8_rows(x)
    assert q.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(scale[:, 0], (x.abs().amax(1) / 448).clamp(min=1e-12 / 448))
    nonzero = [0, 1, 2, 4, 5]
    assert torch.equal(q[nonzero].float().abs().amax(1), torch.full((5,), 448.0))
    assert bool((q[3].float() == 0).all())
    err = (q.float() * scale - x).abs()
    assert bool((err <= x.abs() * 2**-4 + scale * 2**-9).all())   # half a step, subnormals included
    q, scale = kernels.quantize_fp8_rows(x, torch.tensor(0.01))
    assert torch.equal(scale, torch.full((6, 1), 0.01)) and float(q.float().abs().max()) == 448.0


def _compare(device, static: torch.Tensor | None):
    x = _rows(device).bfloat16() if device.type == "cuda" else _rows(device)
    q, scale = kernels.quantize_fp8_rows(x, static)
    q_ref, scale_ref = quantize_fp8_rows_ref(x.cpu(), None if static is None else static.cpu())
    torch.testing.assert_close(scale.cpu(), scale_ref, rtol=1e-6, atol=0)
    return q.cpu().float(), q_ref.float()


@pytest.mark.parametrize("static", [None, torch.tensor([0.02])])
def test_triton_places_and_scales_like_the_reference(triton_backend, static):
    got, want = _compare(triton_backend, None if static is None else static.to(triton_backend))
    assert bool((got[3] == 0).all())                            # the all-zero row
    normal = want.abs() >= 2**-5
    ratio = got[normal] / want[normal]
    assert bool(((ratio == 1) | (ratio == 0.5)).all()) and float((ratio == 1).float().mean()) > 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("static", [None, torch.tensor([0.02])])
def test_triton_codes_equal_the_reference_on_the_gpu(triton_backend, static):
    got, want = _compare(triton_backend, None if static is None else static.to(triton_backend))
    assert int((got != want).sum()) <= 8
    torch.testing.assert_close(got, want, rtol=2**-3, atol=2**-9)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="must be \\[num_tokens, features\\]"):
        kernels.quantize_fp8_rows(torch.zeros(3))
    with pytest.raises(ValueError, match="one fp32 value"):
        kernels.quantize_fp8_rows(torch.zeros(2, 4), torch.ones(2))
