"""Pure-torch per-row fp8 (e4m3) quantization of activations: the reference and the CPU path.

Each row gets its own scale ``max|x| / 448`` (dynamic, per token) unless one static per-tensor
scale is given (a checkpoint's ``input_scale``); values are divided by it, saturated to +-448 and
rounded to nearest even. An all-zero row keeps a tiny positive scale, so it quantizes to zeros.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3 value
MIN_SCALE = 1e-12 / 448  # the scale of an all-zero row: zeros, never NaN


def quantize_fp8_rows_ref(
    x: torch.Tensor,  # [num_tokens, features], any float dtype
    static_scale: torch.Tensor | None = None,  # [] or [1] fp32, or None: per-row scales
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(x_q [num_tokens, features] float8_e4m3fn, scale [num_tokens, 1] fp32)`` with
    ``x ~= x_q * scale``."""
    x = x.float()
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale
