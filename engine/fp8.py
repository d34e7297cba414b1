"""FP8 (e4m3) linears (`--quantization fp8`): per-output-channel weight scales, per-token activations.

Design: a weight is stored as float8_e4m3fn with one fp32 scale per output channel (max|w| / 448),
so a fused q/k/v or gate/up matrix keeps each part's own scales and a checkpoint quantized per
tensor loads unchanged (its scale repeated over the part's rows). Each activation row is quantized
on the fly with its own scale (max|x| / 448), or with the checkpoint's static `input_scale`. The
product is `(x_q @ w_q^T) * x_scale * w_scale`, accumulated in fp32:

* GPUs with fp8 tensor cores (compute capability >= 8.9) run it as one `torch._scaled_mm` with
  row-wise scales (`[T, 1]` and `[1, out]`), the scales applied in its epilogue. Where that torch
  build lacks row-wise scaling (it came with sm90 kernels) the same call runs with unit scales
  and an fp32 output, and the two scales are applied after it: same math, one more pass.
* Everywhere else (CPU, older GPUs) the reference path dequantizes: fp8 values are exact in
  bf16/fp16/fp32, so `x_q` and `w_q` are upcast (fp32 on CPU, the model dtype on a GPU), multiplied,
  and scaled. It computes what `_scaled_mm` computes, up to summation order, and is what the CPU
  tests measure; on CPU it is a correctness path, not a fast one (the weight is upcast per call).

Only the decoder's projections are quantized: the embedding and the lm_head stay in the model
dtype (Hugging Face FP8 checkpoints keep them so, and quantize-at-load does the same, so both give
the same model), and so do the routers of a mixture of experts (`mlp.gate`, `shared_expert_gate`:
a top-k choice flips on small errors, and they are tiny). The experts themselves are quantized
the same way, per output channel, in their 3-D stacks (`quantize_experts_fp8`); they run as
weight-only fp8 (activations in the model dtype) inside `kernels.fused_moe`. The KV cache is
separate (`--kv-cache-dtype`, engine/kv_dtype.py).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.models.moe import Experts

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite e4m3 value
_MIN_SCALE = 1e-12         # an all-zero row or channel quantizes to zeros, not NaN
SCALED_MM_CAPABILITY = (8, 9)


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., out, in]` float -> (`[..., out, in]` float8_e4m3fn, `[..., out]` fp32 scales), per
    output channel (of each expert, for a stack of experts)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX
    return (w / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, in]` float -> (`[T, in]` float8_e4m3fn, `[T, 1]` fp32 scales): per token (dynamic), or
    with one static per-tensor scale (`[]` fp32, a checkpoint's `input_scale`), saturating. One
    Triton launch on CUDA (`kernels.quantize_fp8_rows`), the torch reference elsewhere."""
    return kernels.quantize_fp8_rows(x, static_scale)


def scaled_mm_capable(device: torch.device) -> bool:
    """A CUDA device with fp8 tensor cores (capability >= 8.9) and a torch with `_scaled_mm`."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= SCALED_MM_CAPABILITY)


def _index(device: torch.device) -> int | None:
    """The device's index, the current one for a bare "cuda" (one cache entry per real device)."""
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index


@functools.cache
def _rowwise_scaled_mm(device_type: str, device_index: int | None, out_dtype: torch.dtype) -> bool:
    """Whether `_scaled_mm` takes row-wise scales here (probed once per device and dtype)."""
    device = torch.device(device_type, device_index)
    a = torch.ones((16, 32), device=device).to(FP8)
    b = torch.ones((16, 32), device=device).to(FP8)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones((16, 1), device=device),
                         scale_b=torch.ones((1, 16), device=device), out_dtype=out_dtype)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        log.warning("torch._scaled_mm has no row-wise scaling here (%s): fp8 linears scale after the "
                    "matmul instead", str(e).splitlines()[0][:200])
        return False
    return True


class Fp8Linear(nn.Module):
    """A linear layer with e4m3 weights (per-channel scales) and fp8 activations; output in x's dtype.

    `weight` and `weight_scale` are parameters so the checkpoint loader fills them in place
    (engine/fp8_checkpoint.py); `input_scale` (static activation scale) is None for dynamic."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype,
                 device: torch.device, static_input_scale: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros((out_features, in_features), dtype=FP8, device=device),
                                   requires_grad=False)                                  # [out, in]
        self.weight_scale = nn.Parameter(torch.ones(out_features, device=device), requires_grad=False)  # [out]
        self.input_scale = (nn.Parameter(torch.ones((), device=device), requires_grad=False)
                            if static_input_scale else None)                             # [] or None
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
                     if bias else None)
        # _scaled_mm needs both matrix dims divisible by 16; other shapes take the reference path.
        self.use_scaled_mm = (scaled_mm_capable(device) and in_features % 16 == 0 and out_features % 16 == 0)
        if self.use_scaled_mm:  # probe now, never first inside a CUDA graph capture
            _rowwise_scaled_mm(device.type, _index(device), bias_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize a loaded float linear (quantize-at-load)."""
        if linear.weight.is_mkldnn:
            raise ValueError("quantize before packing: the weight is already a oneDNN tensor")
        out_features, in_features = linear.weight.shape
        device = linear.weight.device
        layer = cls(in_features, out_features, linear.bias is not None, linear.weight.dtype, device)
        weight, scale = quantize_weight_fp8(linear.weight)
        layer.weight.data.copy_(weight)
        layer.weight_scale.data.copy_(scale)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if not x.shape[0]:
            return x.new_empty((0, self.out_features))
        x_q, x_scale = quantize_rows_fp8(x, self.input_scale)                   # [T, in] fp8, [T, 1]
        if self.use_scaled_mm:
            y = self._scaled_mm(x_q, x_scale, x.dtype)
        else:
            y = self._dequantized_mm(x_q, x_scale, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _scaled_mm(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        w_t = self.weight.t()                               # [in, out], column-major as _scaled_mm wants
        w_scale = self.weight_scale[None, :]                # [1, out]
        device = x_q.device
        if _rowwise_scaled_mm(device.type, _index(device), out_dtype):
            return torch._scaled_mm(x_q, w_t, scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
        one = torch.ones((), device=device)
        acc = torch._scaled_mm(x_q, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (acc * x_scale * w_scale).to(out_dtype)

    def _dequantized_mm(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # e4m3 values are exact in fp32/bf16/fp16: only the accumulation differs from _scaled_mm.
        compute = torch.float32 if x_q.device.type == "cpu" else out_dtype
        acc = F.linear(x_q.to(compute), self.weight.to(compute)).float()       # [T, out]
        return (acc * x_scale * self.weight_scale).to(out_dtype)

    def extra_repr(self) -> str:
        act = "static" if self.input_scale is not None else "dynamic per-token"
        path = "_scaled_mm" if self.use_scaled_mm else "dequantized reference"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {act}, {path}"


def is_quantized_projection(name: str) -> bool:
    """The linears fp8 quantizes: every decoder projection, not the lm_head nor an MoE router."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ("lm_head", "shared_expert_gate") and not name.endswith(".mlp.gate")


def quantize_experts_fp8(experts: nn.Module) -> None:
    """An MoE layer's `Experts` (engine/models/moe.py): both weight stacks to e4m3 in place, with
    their per-channel scales beside them (`gate_up_scale [E, 2I]`, `down_scale [E, H]`)."""
    for name, scale_name in (("gate_up_proj", "gate_up_scale"), ("down_proj", "down_scale")):
        weight, scale = quantize_weight_fp8(getattr(experts, name))
        setattr(experts, name, nn.Parameter(weight, requires_grad=False))
        setattr(experts, scale_name, scale)


def quantize_model_fp8(model: nn.Module) -> int:
    """Swap every decoder projection (not the lm_head, not a router) for an `Fp8Linear`, and
    quantize every expert stack, in place; returns how many projections (an expert stack counts
    as two). Call after the weights are loaded and before the runner packs them."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, Experts):
            quantize_experts_fp8(parent)
            swapped += 2
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and is_quantized_projection(full):
                setattr(parent, name, Fp8Linear.from_linear(child))
                swapped += 1
    if swapped and not any(m.use_scaled_mm for m in model.modules() if isinstance(m, Fp8Linear)):
        log.info("fp8 linears run the dequantizing reference path here (no fp8 tensor cores)")
    return swapped


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (what the weights take in memory)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_mkldnn)
