"""One pre-norm decoder layer: `x + attn(norm(x))`, then `+ mlp(norm(.))`, residual fused into the norms.

The MLP is whatever the family builds for this layer (a dense `MLP`, or a mixture of experts):
the layer only needs `mlp(h: [T, hidden]) -> [T, hidden]`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.attention import Attention
from engine.models.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, dtype: torch.dtype, device: torch.device,
                 comm=None, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, comm, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden], the previous layer's output; residual: the stream before it (None at
        the first layer). Returns this layer's `(output, residual)`, both [T, hidden]."""
        h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, positions, rope_cache, key_cache, value_cache, meta)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual
