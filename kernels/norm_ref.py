"""Pure-torch RMSNorm with Hugging Face LlamaRMSNorm semantics (reference and CPU runtime path)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``, as LlamaRMSNorm."""
    # x: [..., hidden]; weight: [hidden]
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; the sum is taken in x's dtype, as in HF."""
    hidden = residual + x
    return rms_norm_ref(hidden, weight, eps), hidden
