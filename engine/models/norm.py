"""RMSNorm with Hugging Face LlamaRMSNorm numerics, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`(norm(x), x)`, or with `residual`: `(norm(x + residual), x + residual)` in one pass."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps), x
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., size] -> [..., size]` normalized over the last dim (per-head q/k norms)."""
        return kernels.rms_norm(x, self.weight, self.eps)
