"""Triton RMSNorm and fused residual-add + RMSNorm: one program per row.

Numerics follow Hugging Face LlamaRMSNorm step by step: the (optional) residual sum is rounded
to the input dtype, the normalisation runs in fp32 and is rounded to the input dtype, and only
then multiplied by the weight (in fp32, rounded to the promoted output dtype), so results match
the torch reference bit for bit up to reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [rows, hidden]
    sum_ptr,  # [rows, hidden] x + residual (written only when HAS_RESIDUAL)
    x_ptr,  # [rows, hidden]
    residual_ptr,  # [rows, hidden] (read only when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    eps,
    hidden,
    stride_out, stride_sum, stride_x, stride_res,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_res + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + offs, x, mask=ok)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with unit stride on hidden (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            out, summed, x2, r2, weight.contiguous(), eps, hidden,
            out.stride(0), summed.stride(0), x2.stride(0), r2.stride(0),
            BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
        )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (inputs already validated by ``kernels.checks``)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` from one pass over the row."""
    return _launch(x, residual, weight, eps)
