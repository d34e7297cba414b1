"""Pure-torch fused MoE experts (reference and CPU path): SwiGLU experts over routed tokens.

``out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = ids[t, k]``, for
experts stored as ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``.

Cost follows the active experts, not all of them: the ``T * top_k`` slots are sorted by expert
once (one stable argsort), and only experts that got tokens run, each as two matmuls over its
contiguous run of rows. The per-expert counts are read on the host (one small read per layer):
this is the CPU path; the Triton kernel does the same grouping on the device (``moe_align``).

Numerics follow transformers' expert loop step by step: the gate/up projection, the activation
and the down projection each round to x's dtype, the routing weight multiplies in fp32 and the
product rounds to x's dtype; the ``top_k`` contributions of a token are summed in fp32 and
rounded once (transformers adds them in x's dtype, expert by expert: equal in fp32). Optional
``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` (fp32, one per output channel) dequantize fp8
weights: the matmul runs on the upcast weight and its output columns are scaled.

gpt-oss's experts (``activation="swiglu_oai"``) add per-expert biases ``w13_bias [E, 2I]`` /
``w2_bias [E, H]`` after each projection (and its scale) and gate with transformers'
``GptOssExperts._apply_gate``: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
``(up + 1) * gate * sigmoid(alpha * gate)``.

``linear(x, w)`` and the weight containers are parameters so the CPU model can run the same
loop over its oneDNN-packed per-expert weights (any ``w13[e]`` its ``linear`` accepts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref


ACTIVATIONS = ("silu", "swiglu_oai")


def _expert_linear(linear: Callable, x: torch.Tensor, weight, scale: torch.Tensor | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        y = linear(x, weight)
    else:
        y = (linear(x, weight.to(x.dtype)).float() * scale).to(x.dtype)   # fp8: per output channel
    return y if bias is None else y + bias


def swiglu_oai_ref(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of ``h = cat(gate, up)`` ([n, 2I] -> [n, I]), in h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The experts' gate: ``silu(gate) * up``, or gpt-oss's clamped variant."""
    return silu_and_mul_ref(h) if activation == "silu" else swiglu_oai_ref(h, alpha, limit)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | Sequence,  # [E, 2I, H], or E weights `linear` takes
    w2: torch.Tensor | Sequence,  # [E, H, I], or E weights
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,  # [T, K] int
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32 (fp8 weights)
    w2_scale: torch.Tensor | None = None,  # [E, H] fp32
    linear: Callable[[torch.Tensor, object], torch.Tensor] = F.linear,
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] in x's dtype
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """``[T, H]`` in x's dtype (see the module docstring)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                     # [T*K] slots grouped by expert
    counts = torch.bincount(flat, minlength=len(w13)).tolist()   # the one host read
    rows = x.index_select(0, order // top_k)                     # [T*K, H] each slot's token
    outputs = []
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        seg = rows[start:start + n]
        h = _expert_linear(linear, seg, w13[e], None if w13_scale is None else w13_scale[e],
                           None if w13_bias is None else w13_bias[e])                                   # [n, 2I]
        y = _expert_linear(linear, expert_activation(h, activation, swiglu_alpha, swiglu_limit), w2[e],
                           None if w2_scale is None else w2_scale[e], None if w2_bias is None else w2_bias[e])  # [n, H]
        outputs.append(y)
        start += n
    hidden = x.shape[1]
    y_sorted = torch.cat(outputs) if outputs else x.new_empty((0, hidden))
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)          # [T*K, H] in slot order
    y = (y.float() * topk_weights.reshape(-1, 1)).to(x.dtype)
    return y.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
