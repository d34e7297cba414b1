"""Linear layers on oneDNN's packed weights (CPU), plain `F.linear` elsewhere.

On CPU, `Linear.pack()` (the model's `pack_weights()`, called once by the runner after loading)
reorders each weight once into oneDNN's blocked layout, replacing the plain copy (memory-neutral),
and the matmuls run oneDNN's brgemm kernels. For the small row counts of decode steps this is
~1.3-2x faster than `F.linear` (MKL) in fp32, and in bf16 it is the path that uses avx512_bf16
on half the weight bytes (see bench/step_time.py); bf16 prefill-sized matmuls run in fp32 instead
(`BF16_UPCAST_ROWS`). `pack_weight` / `linear` are the same two steps on a bare weight tensor,
for layers that hold many weights in one module (the experts of a mixture of experts).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Rows the packed layout is tuned for (oneDNN's hint); any row count runs on it.
PACK_BATCH_HINT = 8
# Without AMX, oneDNN's bf16 matmul is ~1.7x slower than fp32 once it is compute-bound; from this
# many rows on, a bf16 layer unpacks its weight to fp32 for the call (costs one weight pass).
BF16_UPCAST_ROWS = 256
PACKABLE = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch has oneDNN (mkldnn) and its prepacked linear ops for `dtype` (bf16
    needs a CPU with avx512 or avx_ne_convert: oneDNN refuses to pack it elsewhere)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16_supported()


@functools.cache
def _onednn_bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, in]; weight: [out, in], plain or oneDNN-packed -> [T, out]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`[out, in]` CPU weight -> its oneDNN-packed copy (opaque `is_mkldnn`, same shape and dtype),
    or None where it cannot be packed (another device or dtype, no oneDNN)."""
    if weight.is_mkldnn:
        return weight
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE or not onednn_linear_available(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for a plain or a `pack_weight`-packed weight: `[T, in] -> [T, out]`."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and x.shape[0] >= BF16_UPCAST_ROWS:  # prefill-sized
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.to_dense().float(), bias).to(x.dtype)
    return onednn_linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` that can swap its weight for a oneDNN-packed copy (`pack`), CPU only."""

    def pack(self) -> bool:
        """Reorder the weight into oneDNN's layout, in place of the plain one; False if not done.

        Afterwards `weight` is a non-persistent buffer holding an opaque (`is_mkldnn`) tensor of
        the same shape and dtype: it is no longer a parameter, so load weights before packing."""
        if self.weight.is_mkldnn:
            return True
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
