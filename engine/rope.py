"""RoPE frequencies with the scalings checkpoints use (linear, llama3, YaRN), as one cos/sin table.

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
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN (gpt-oss): interpolate the low frequencies by `factor`, keep the high ones, and ramp
    linearly between the dimensions that turn `beta_slow` and `beta_fast` times over the original
    context; transformers' `_compute_yarn_parameters`, step for step."""
    base, factor, old_len = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's `0.1 ln(factor) + 1` unless the config gives it;
    1 for every other RoPE."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_position: int, device: torch.device) -> torch.Tensor:
    """`[max_position, head_dim]` fp32 = cat(cos, sin), each `[max_position, head_dim // 2]`."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    scale = attention_factor(rope)
    if scale != 1.0:
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
