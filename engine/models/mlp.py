"""The dense gated MLP: `down(act(gate(x)) * up(x))` with gate and up fused into one matmul; `act`
is silu (SwiGLU) or, for Gemma, tanh-approximate GELU (GeGLU)."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.models.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 comm=None, activation: str = "silu") -> None:
        """`intermediate_size` is this rank's share under tensor parallelism. `comm`: the
        collectives when this MLP ends its own block (down_proj is row-parallel: one all-reduce);
        None when the caller sums it with something else first (a shared expert). `activation`:
        "silu" or "gelu_pytorch_tanh" (engine.model_config.ACTIVATIONS)."""
        super().__init__()
        self.comm = comm
        self.act_and_mul = kernels.gelu_tanh_and_mul if activation == "gelu_pytorch_tanh" else kernels.silu_and_mul
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))   # [T, 2I] -> [T, I] -> [T, hidden]
        return out if self.comm is None else self.comm.all_reduce(out)
