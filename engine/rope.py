"""RoPE frequencies with the scalings Llama checkpoints use (linear, llama3), as one cos/sin table.

The table is computed once in fp32 exactly as transformers does, so positions match it bit for bit.
"""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_position: int, device: torch.device) -> torch.Tensor:
    """`[max_position, head_dim]` fp32 = cat(cos, sin), each `[max_position, head_dim // 2]`."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
