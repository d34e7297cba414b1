"""MXFP4 weights (gpt-oss's experts) as transformers stores them, dequantized at load.

The OCP microscaling format: groups of 32 values along a row share one power-of-two scale; each
value is a 4-bit e2m1 float. transformers' checkpoints store a `[..., rows, cols]` weight as
`<name>_blocks [..., rows, cols / 32, 16]` uint8 (two values per byte, the even column in the low
nibble) and `<name>_scales [..., rows, cols / 32]` uint8 (the exponent biased by 127), and
`integrations/mxfp4.py` dequantizes them with a 16-entry table and `ldexp`. cbserve has no MXFP4
matmul (no device path reads it yet), so the experts are dequantized once, at load, to the
model's dtype: exact, since every MXFP4 value is representable in bf16 and fp32.
"""

from __future__ import annotations

import torch

# e2m1 values by code: sign bit 3, then exponent and mantissa (transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


class Mxfp4Error(ValueError):
    """MXFP4 blocks and scales that do not describe one weight."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks [..., rows, groups, 16]` uint8 and `scales [..., rows, groups]` uint8 -> the weight
    `[..., rows, groups * 32]` in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise Mxfp4Error(f"MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} must be uint8 [..., groups, 16] and [..., groups]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)                                                             # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents[..., None])
    return out.flatten(-2).to(dtype)                                                        # [..., rows, G*32]
