"""Pure-torch rotary embedding, neox / Hugging Face ``rotate_half`` style (reference and CPU path)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2] fp32
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1).
    # Both halves are written straight into one buffer: four ops and no temporaries (per-step
    # overhead matters on the CPU path, where this runs once per layer for q and for k).
    out = torch.empty(rot.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    out = out.to(x.dtype)
    if 2 * half == x.shape[-1]:
        return out
    return torch.cat((out, x[..., 2 * half:]), dim=-1)  # partial rotary: the tail passes through


def apply_rope_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] = cat(cos, sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of every head by its token's position; fp32 math."""
    cos_sin = cos_sin_cache[positions].float()  # [num_tokens, rotary_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # each [num_tokens, 1, rotary_dim // 2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
