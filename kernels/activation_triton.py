"""Triton gated activations in one pass over the fused gate/up output: SwiGLU ``silu(gate) * up``
(Llama, Qwen, Mistral) and GeGLU ``gelu_tanh(gate) * up`` (Gemma 3).

Unfused, ``act(gate) * up`` is two launches and writes then re-reads a ``[T, I]`` temporary;
here each program reads one block of gate and up and writes the product. Numerics follow the
two torch ops step by step: the activation in fp32 rounded to x's dtype, then the product in fp32
rounded again, so half-precision results match the reference up to the last bit of ``exp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per program: 2 x 2 KB of bf16 reads, enough to keep a load in flight
SILU, GELU_TANH = 0, 1


@triton.jit
def _gated_act_kernel(
    out_ptr,  # [num_tokens, intermediate], unit stride on the last dim
    x_ptr,  # [num_tokens, 2 * intermediate] = cat(gate, up), unit stride on the last dim
    intermediate,
    stride_out, stride_x,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,  # SILU or GELU_TANH
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:  # F.gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * inner)))  # 1 + tanh(y) = 2 sigmoid(2y)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty)  # the activation op rounds here
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, act: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    _gated_act_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        out, x, intermediate, out.stride(0), x.stride(0), BLOCK=block, ACT=act,
    )
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I] -> [T, I]`` (input already validated by ``kernels.checks``)."""
    return _launch(x, SILU)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I] -> [T, I]``, tanh-approximate GELU (input already validated)."""
    return _launch(x, GELU_TANH)
