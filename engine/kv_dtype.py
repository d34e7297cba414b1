"""`--kv-cache-dtype`: the KV cache in the model dtype (`auto`) or in fp8 e4m3 with per-tensor scales.

Design: an fp8 cache stores `K / k_scale` and `V / v_scale` (float8_e4m3fn, 1 byte per element,
half of bf16: twice the tokens in the same memory, half the bytes a decode step reads). The scales
are static, one pair per layer: the checkpoint's `self_attn.k_scale` / `v_scale` when it has them
(engine/fp8_checkpoint.py), else 1.0. Not computed at run time: a paged cache is written token by
token over a request's life, and entries already written cannot follow a scale that changes later;
a scale calibrated once at start-up would depend on the calibration input and differ between the
prefill and decode pods that exchange these bytes. 1.0 is vLLM's default too: e4m3 covers
|x| <= 448 with 3 mantissa bits down to 2**-6, which holds Llama-family K/V activations (O(1)-O(10));
the kernels saturate rather than overflow beyond it.

Pods that exchange KV must agree on dtype and scales: the dtype travels in the handshake's
`ModelInfo.kv_dtype` (kvtransfer/layout.py refuses a mismatch), and the scales, static per model,
travel as a digest appended to the model fingerprint (`kv_scales_suffix`), which the handshake
compares; the fp8 bytes themselves move like any other KV bytes.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import nn

from engine.config import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_CAPABILITY = (8, 9)   # hardware e4m3 conversions (Ada, Hopper): what the Triton kernels use


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype` -> the cache's torch dtype; refuses fp8 on a GPU without e4m3 support."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if name == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_KV_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--kv-cache-dtype {name} needs a GPU of compute capability >= 8.9 (Ada, Hopper) for "
                         f"e4m3 conversions in the attention kernels; this one is {major}.{minor}: use auto")
    return FP8_KV_DTYPE


def kv_scales(model: nn.Module) -> list[tuple[float, float]]:
    """Every layer's (k_scale, v_scale), in layer order."""
    return [layer.self_attn.kv_scales for layer in model.layers]


def kv_scales_suffix(model: nn.Module) -> str:
    """The fingerprint suffix of an fp8 cache: `+kv-fp8-` and a digest of every layer's scales."""
    packed = b"".join(struct.pack("<ff", k, v) for k, v in kv_scales(model))
    return "+kv-fp8-" + hashlib.sha256(packed).hexdigest()[:8]
