"""W8A8 int8 linears for the CPU runtime (`--quantization int8`).

Design: weights are quantized once, symmetric per output channel (scale = max|w| / 127); each
activation row is quantized on the fly, symmetric per token. The product runs as an exact int8 x
int8 -> int32 matmul (`torch._int_mm`, oneDNN's VNNI kernel on x86), then the two scales turn the
int32 sums back into floats. Per-token scales keep a row's result independent of the other rows in
the batch, and integer sums are exact whatever the kernel's blocking, so the linears are exactly
batch-invariant. Attention stays float and its rounding still depends on where a prompt's chunks
start; int8 activations amplify that noise (a value at a rounding edge lands on the other side), so
where chunk boundaries differ a greedy near-tie flips more often than in fp32. On a core without
AMX the int8 matmul runs at about 4x fp32's rate (prefill: the whole `small` step 2.3x) and reads a
quarter of the weight bytes (decode); the cost is ~1% relative error per projection. Both are
measured in tests/engine/test_quant.py and `bench/step_time.py --dtypes float32,int8`.

Kernel: oneDNN's prepacked int8 linear (`onednn::qlinear_pointwise`) with the weight reordered once
and the per-channel weight scale fused into its output; it takes unsigned activations, so a row is
shifted by +128 and handed over with zero point 128 (oneDNN subtracts the zero point's term exactly
in integers). Its result equals `_int_mm(x, w.t()) * w_scale` bit for bit and runs 1.2-1.8x faster
from 8 rows up (no per-call weight reorder); builds without oneDNN take `torch._int_mm` instead.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.config import QUANTIZATIONS
from engine.fp8 import quantize_model_fp8
from engine.models.moe import Experts

_QMAX = 127.0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float -> (`[out, in]` int8, `[out]` fp32 scales), symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / _QMAX
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _scaled_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, in]` -> (`[T, in]` fp32 integers in [-127, 127], `[T, 1]` fp32 scales).

    |x| * 127 / max|x| is at most 127 up to rounding, so no clamp is needed."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return (x * (_QMAX / amax)).round_(), amax / _QMAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, in]` float -> (`[T, in]` int8, `[T, 1]` fp32 scales), symmetric per row."""
    scaled, scale = _scaled_rows(x)
    return scaled.to(torch.int8), scale


@functools.cache
def onednn_int8_available() -> bool:
    """oneDNN's qlinear runs here AND gives the exact int32 product. CPUs without VNNI (plain
    AVX2) sum u8 x s8 pairs in saturating int16 (`vpmaddubsw`), so full-range activations come
    out wrong there: a one-time probe against `torch._int_mm` decides."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    w[:, :4], x[:, :4] = 127, 127           # the pairs that overflow int16 when saturating
    try:
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        y = torch.ops.onednn.qlinear_pointwise((x.float() + 128).to(torch.uint8), 1.0, 128, packed,
                                               torch.ones(32), torch.zeros(32, dtype=torch.long), None,
                                               1.0, 0, torch.float32, "none", [], "")
    except RuntimeError:
        return False
    return torch.equal(y, torch._int_mm(x, w.t()).float())


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and per-token int8 activations; output in the input dtype."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        self.register_buffer("weight_scale", weight_scale, persistent=False)  # [out] fp32
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.onednn = onednn_int8_available() and weight_q.device.type == "cpu"
        if self.onednn:  # opaque oneDNN layout, reordered once
            weight_q = torch.ops.onednn.qlinear_prepack(weight_q, None)
            self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.long),
                                 persistent=False)
        self.register_buffer("weight_q", weight_q, persistent=False)          # [out, in] int8

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        if linear.weight.is_mkldnn:
            raise ValueError("quantize before packing: the weight is already a oneDNN tensor")
        weight_q, scale = quantize_weight(linear.weight)
        return cls(weight_q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if not x.shape[0]:
            return x.new_empty((0, self.out_features))
        scaled, x_scale = _scaled_rows(x)
        if self.onednn:
            x_u8 = scaled.add_(128.0).to(torch.uint8)              # [T, in] in [1, 255], zero point 128
            y = torch.ops.onednn.qlinear_pointwise(x_u8, 1.0, 128, self.weight_q, self.weight_scale,
                                                   self.weight_zero_point, None, 1.0, 0, torch.float32,
                                                   "none", [], "")
        else:
            acc = torch._int_mm(scaled.to(torch.int8), self.weight_q.t())  # [T, out] int32, exact
            y = torch.mul(acc, self.weight_scale)                  # int32 * fp32 -> fp32, one pass
        y.mul_(x_scale)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 w8a8"


def quantize_model(model: nn.Module, quantization: str, device: torch.device) -> int:
    """Swap every `nn.Linear` of `model` for its quantized form, in place; returns how many
    (`fp8`: engine/fp8.py, every projection but the lm_head).

    Call after the weights are loaded and before the runner packs them."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "fp8":
        return quantize_model_fp8(model)
    if device.type != "cpu":
        raise ValueError("int8 quantization runs on CPU only (it targets oneDNN's VNNI kernels); "
                         "on a GPU serve bfloat16")
    moe = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if moe is not None:
        family = getattr(getattr(model, "cfg", None), "architecture", "this model")
        raise ValueError(f"--quantization int8 does not cover mixture-of-experts layers ({family}, "
                         f"{moe.gate_up_proj.shape[0]} experts): serve it unquantized or with --quantization fp8")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
                swapped += 1
    return swapped
