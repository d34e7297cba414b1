"""Triton fused MoE: every expert's matmuls in one grouped GEMM launch per projection.

The routed slots are first sorted by expert and padded to whole ``BLOCK_M`` blocks on the device
(``moe_align.moe_align_block_size``); then one program computes one ``[BLOCK_M, BLOCK_N]`` tile of
one block, against the one expert that block belongs to (vLLM's ``fused_moe_kernel`` design):

1. gate/up: ``inter[slot] = silu(x[token] @ W_gate[e].T) * (x[token] @ W_up[e].T)``, the two
   halves of ``w13`` accumulated side by side and the SwiGLU applied in the epilogue, so the
   ``[T*K, 2I]`` projection never reaches memory;
2. down: ``y[slot] = w[slot] * (inter[slot] @ W_down[e].T)``, the routing weight applied in the
   epilogue; then ``sum_k y`` per token (fp32, one torch reduction).

Each active expert's weights are read once per output tile column, empty experts not at all, and
padding rows are masked (never loaded, never stored). Launch grids depend on the shapes alone
(``moe_align.max_padded_slots``); programs past the device-side ``num_padded`` return at once: no
host read, so a decode step captures into a CUDA graph. Rounding follows the reference
(``moe_ref``): each projection's output rounds to x's dtype, then the activation, then the
weighted product; fp8 weights (``w13_scale`` / ``w2_scale``, per output channel) are upcast to x's
dtype as they load and their scales applied to the fp32 accumulators. gpt-oss (``OAI``): per-expert
biases join the accumulators after the scales, and the gate is its clamped SwiGLU
(``(min(up', limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, ``up'`` clamped both sides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_align import moe_align_block_size


@triton.jit(do_not_specialize=["num_slots"])
def _moe_gemm_kernel(
    c_ptr,  # [num_slots, N] output rows, by slot
    a_ptr,  # [rows, K] input rows; slot s reads row s // A_DIV
    b_ptr,  # [E, N or 2N, K] expert weights
    b_scale_ptr,  # [E, N or 2N] fp32 per-channel scales (read when HAS_SCALE)
    bias_ptr,  # [E, N or 2N] per-expert biases (read when HAS_BIAS)
    weights_ptr,  # [num_slots] fp32 routing weights (read when MUL_WEIGHT)
    sorted_slots_ptr,  # [max_padded] int32, sentinel num_slots
    block_experts_ptr,  # [max_padded // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_slots, N, K,
    stride_cm, stride_am, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_ze, stride_zn,
    alpha, limit,  # OAI's gate (unused otherwise)
    A_DIV: tl.constexpr,
    SWIGLU: tl.constexpr,  # b holds [gate; up] (2N rows): write silu(gate) * up
    MUL_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OAI: tl.constexpr,  # gpt-oss's clamped SwiGLU instead of silu(gate) * up
    IEEE_FP32: tl.constexpr,  # fp32 inputs: full-precision dot products, not tf32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    a_rows = (slots // A_DIV).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)                                                          # [BM, BK]
        b_mask = k_ok[:, None] & n_ok[None, :]
        b_off = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn               # [BK, BN]
        b = tl.load(b_base + b_off, mask=b_mask, other=0.0).to(a.dtype)
        if IEEE_FP32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SWIGLU:
            b_up = tl.load(b_base + N * stride_bn + b_off, mask=b_mask, other=0.0).to(a.dtype)
            if IEEE_FP32:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
    out_ty = c_ptr.dtype.element_ty
    if HAS_SCALE:
        s_base = b_scale_ptr + expert * stride_se
        acc = acc * tl.load(s_base + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
        if SWIGLU:
            acc_up = acc_up * tl.load(s_base + (N + offs_n) * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        z_base = bias_ptr + expert * stride_ze
        acc += tl.load(z_base + offs_n * stride_zn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(z_base + (N + offs_n) * stride_zn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(out_ty).to(tl.float32)                      # the projection rounds to x's dtype
    if SWIGLU:
        if OAI:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up.to(out_ty).to(tl.float32), -limit), limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))   # gate * sigmoid(alpha * gate)
        else:
            act = (acc / (1.0 + tl.exp(-acc))).to(out_ty).to(tl.float32)   # F.silu rounds here
            acc = act * acc_up.to(out_ty).to(tl.float32)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
    c = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(out_ty), mask=valid[:, None] & n_ok[None, :])


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: small when each expert sees few rows (decode), larger once they fill a
    tile (prefill). Untuned defaults (no per-GPU tables yet)."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _tile(size: int, most: int) -> int:
    # A power of two in [16, most] (tl.dot needs >= 16).
    return max(16, min(most, triton.next_power_of_2(size)))


def _launch(c, a, b, b_scale, weights, align, num_slots: int, a_div: int, swiglu: bool, block_m: int,
            bias=None, oai: tuple[float, float] | None = None) -> None:
    """One grouped GEMM over every block of `align` (sorted slots, block experts, num_padded);
    `bias` [E, rows of b]: gpt-oss's per-expert biases; `oai`: (alpha, limit) of its gate."""
    sorted_slots, block_experts, num_padded = align
    n, k = c.shape[1], a.shape[1]
    has_scale = b_scale is not None
    scale = b_scale if has_scale else weights          # any fp32 tensor: not read
    has_bias = bias is not None
    bias_t = bias if has_bias else weights
    block_n = _tile(n, 64)
    block_k = _tile(k, 128)   # long reduction tiles keep more weight bytes in flight per program
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    alpha, limit = oai or (1.0, 0.0)
    _moe_gemm_kernel[grid](
        c, a, b, scale, bias_t, weights, sorted_slots, block_experts, num_padded, num_slots, n, k,
        c.stride(0), a.stride(0), b.stride(0), b.stride(1), b.stride(2),
        scale.stride(0) if has_scale else 0, scale.stride(1) if has_scale else 0,
        bias_t.stride(0) if has_bias else 0, bias_t.stride(1) if has_bias else 0, float(alpha), float(limit),
        A_DIV=a_div, SWIGLU=swiglu, MUL_WEIGHT=not swiglu, HAS_SCALE=has_scale, HAS_BIAS=has_bias,
        OAI=oai is not None,
        IEEE_FP32=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
                     swiglu_limit: float = 7.0) -> torch.Tensor:
    """``[T, H]`` in x's dtype (inputs already validated by ``kernels.checks``)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return x.new_empty((0, hidden))
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    num_slots = num_tokens * top_k
    block_m = block_m_for(num_slots, num_experts)
    align = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.reshape(-1).float().contiguous()                     # [T*K]
    inter = torch.empty((num_slots, two_i // 2), dtype=x.dtype, device=x.device)  # by slot
    oai = (swiglu_alpha, swiglu_limit) if activation == "swiglu_oai" else None
    _launch(inter, x, w13, w13_scale, weights, align, num_slots, top_k, True, block_m, w13_bias, oai)
    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)          # by slot, weighted
    _launch(y, inter, w2, w2_scale, weights, align, num_slots, 1, False, block_m, w2_bias)
    return y.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
