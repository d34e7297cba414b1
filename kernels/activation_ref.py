"""Pure-torch SwiGLU activation (reference and CPU path): ``silu(gate) * up`` from one fused
gate/up projection output, with exactly the numerics of ``F.silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
    """``[T, 2 * I] -> [T, I]``: silu of the first half times the second half, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
    """``[T, 2 * I] -> [T, I]``: tanh-approximate GELU of the first half times the second half
    (Gemma's ``gelu_pytorch_tanh`` MLP), in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
