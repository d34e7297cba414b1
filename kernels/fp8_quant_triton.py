"""Triton per-row fp8 (e4m3) activation quantization: one program per row, one launch per linear.

Unfused, per-token quantization is a chain of torch ops (upcast, abs, amax, divide, clamp, cast:
six launches and as many passes) in front of every fp8 matmul, 128 chains per step of an 8B
model: at small batch the launches cost more than the arithmetic. Here each program walks its row
twice in ``BLOCK``-wide chunks (the max, then scale and store), keeping nothing but the running
max in registers, so any row length fits. Static scales skip the first walk. The quotient and the
saturation are the reference's (``fp8_quant_ref``); the GPU's fp32 division may differ from
torch's in the last bit, so a value on an e4m3 rounding edge may take the neighbouring code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant_ref import FP8, MIN_SCALE
from kernels.kv_write_triton import FP8_MAX

_BLOCK = 1024  # columns per chunk


@triton.jit
def _quantize_rows_kernel(
    out_ptr,  # [num_tokens, features] float8_e4m3fn, unit stride on the last dim
    scale_ptr,  # [num_tokens, 1] fp32 (written)
    x_ptr,  # [num_tokens, features], unit stride on the last dim
    static_scale_ptr,  # [1] fp32, read when STATIC
    features,
    stride_out, stride_x,
    min_scale,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, features, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < features, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, features, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < features
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + row * stride_out + cols, q, mask=ok)


def quantize_fp8_rows_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, F] -> ([T, F] float8_e4m3fn, [T, 1] fp32)`` (inputs already validated by ``kernels.checks``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, features = x.shape
    out = torch.empty((num_tokens, features), dtype=FP8, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, scale
    static = static_scale is not None
    _quantize_rows_kernel[(num_tokens,)](
        out, scale, x, static_scale if static else scale, features, out.stride(0), x.stride(0), MIN_SCALE,
        BLOCK=min(_BLOCK, triton.next_power_of_2(max(features, 16))), STATIC=static,
    )
    return out, scale
