"""cbserve kernels: pure functions on tensors, Triton on CUDA and a torch reference elsewhere.

Contracts: docs/architecture.md, section "kernels". Every public function validates its inputs
(``kernels.checks``: shapes and dtypes only), then dispatches through ``kernels.backend``; the
Triton modules are imported only when first chosen, so this package imports (and runs on CPU)
without triton. Nothing here imports from the rest of the project.
"""

from __future__ import annotations

import torch

from kernels import backend, checks
from kernels.activation_ref import gelu_tanh_and_mul_ref, silu_and_mul_ref
from kernels.attention_ref import paged_attention_ref
from kernels.fp8_quant_ref import quantize_fp8_rows_ref
from kernels.grammar_mask_host import apply_grammar_mask_host
from kernels.grammar_mask_ref import apply_grammar_mask_ref
from kernels.kv_write_ref import write_kv_ref
from kernels.lora_ref import LoRAPlan, lora_expand_ref, lora_plan_ref, lora_shrink_ref
from kernels.moe_ref import fused_moe_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rope_kv_ref import rope_and_write_kv_ref
from kernels.rope_ref import apply_rope_ref

__all__ = ["paged_attention", "write_kv", "rms_norm", "fused_add_rms_norm", "apply_rope", "rope_and_write_kv",
           "silu_and_mul", "gelu_tanh_and_mul", "quantize_fp8_rows", "apply_grammar_mask", "fused_moe", "LoRAPlan",
           "lora_plan", "lora_shrink", "lora_expand"]

_use_triton = backend.use_triton
_triton_fn = backend.triton_fn


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] float: sink logits (gpt-oss), or None
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens (its last ``query_len`` positions) over its
    paged K/V; prefill chunks and decode tokens may be mixed. Returns q's shape and dtype.

    The caches are q's dtype, or float8_e4m3fn holding ``K / k_scale`` and ``V / v_scale``
    (dequantized on load; float caches ignore the scales). ``sliding_window`` > 0: a query at
    position p sees keys [p - sliding_window + 1, p] (transformers' mask); the table entries of
    keys no query of the call can see are never read, so they may be the null block. ``sinks``:
    one logit per query head joins each softmax's denominator (a key with no value)."""
    sizes = checks.check_paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                         sliding_window, sinks)
    if _use_triton(q):
        return _triton_fn("attention_triton", "paged_attention_triton")(
            q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sizes, k_scale, v_scale,
            sliding_window, sinks)
    return paged_attention_ref(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               k_scale, v_scale, sliding_window=sliding_window, sinks=sinks)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot = block_id * block_size + offset, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key/value into its cache slot, in place; an fp8 cache gets
    ``K / k_scale`` and ``V / v_scale``, saturated to e4m3's range (float caches ignore the scales)."""
    checks.check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    if _use_triton(key):
        _triton_fn("kv_write_triton", "write_kv_triton")(key, value, key_cache, value_cache, slot_mapping,
                                                         k_scale, v_scale)
    else:
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with Hugging Face LlamaRMSNorm numerics."""
    checks.check_rms_norm(x, weight)
    if _use_triton(x):
        return _triton_fn("norm_triton", "rms_norm_triton")(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; the sum is rounded to x's dtype as in HF."""
    checks.check_rms_norm(x, weight, residual)
    if _use_triton(x):
        return _triton_fn("norm_triton", "fused_add_rms_norm_triton")(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] = cat(cos, sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / HF ``rotate_half`` rotary embedding; returns new ``(q, k)`` in their dtype."""
    checks.check_rope(q, k, positions, cos_sin_cache)
    if _use_triton(q):
        return _triton_fn("rope_triton", "apply_rope_triton")(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)


def rope_and_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] = cat(cos, sin)
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot = block_id * block_size + offset, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` then ``write_kv`` of the rotated keys and ``v``, in one Triton launch on CUDA.

    Returns the rotated ``(q, k)`` (new tensors in q's dtype) exactly as ``apply_rope`` does, and
    leaves the caches exactly as ``write_kv(k_rotated, v, ..., k_scale, v_scale)`` would."""
    checks.check_rope(q, k, positions, cos_sin_cache)
    checks.check_write_kv(k, v, key_cache, value_cache, slot_mapping)
    if _use_triton(q):
        return _triton_fn("rope_kv_triton", "rope_and_write_kv_triton")(
            q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return rope_and_write_kv_ref(q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                 k_scale, v_scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dim ([T, 2 * I] -> [T, I]), with
    the numerics of ``F.silu(gate) * up`` (each op rounds to x's dtype), in one pass on CUDA."""
    checks.check_silu_and_mul(x)
    if _use_triton(x):
        return _triton_fn("activation_triton", "silu_and_mul_triton")(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = cat(gate, up)`` ([T, 2 * I] -> [T, I]; Gemma's GeGLU),
    with the numerics of ``F.gelu(gate, approximate="tanh") * up``, in one pass on CUDA."""
    checks.check_silu_and_mul(x)
    if _use_triton(x):
        return _triton_fn("activation_triton", "gelu_tanh_and_mul_triton")(x)
    return gelu_tanh_and_mul_ref(x)


def quantize_fp8_rows(
    x: torch.Tensor,  # [num_tokens, features], floating point
    static_scale: torch.Tensor | None = None,  # [] or [1] fp32 per-tensor scale; None: one per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scale)``: ``x_q`` float8_e4m3fn ``[num_tokens, features]`` and ``scale`` fp32
    ``[num_tokens, 1]`` with ``x ~= x_q * scale``; per-row scales are ``max|x| / 448``; values
    saturate at +-448. One launch on CUDA (the activations of an fp8 linear)."""
    checks.check_quantize_fp8_rows(x, static_scale)
    if _use_triton(x):
        return _triton_fn("fp8_quant_triton", "quantize_fp8_rows_triton")(x, static_scale)
    return quantize_fp8_rows_ref(x, static_scale)


def apply_grammar_mask(
    logits: torch.Tensor,  # [num_seqs, vocab] float, written in place
    bitmask: torch.Tensor,  # [num_masks, words] int32, LSB first, bit 1 = allowed
    rows: torch.Tensor | None,  # [num_masks] int64: the logits row of each mask (distinct); None: 0..num_masks-1
) -> None:
    """Structured outputs: ``logits[rows[j], t] = -inf`` wherever bit ``t`` of ``bitmask[j]`` is 0
    or ``t >= 32 * words`` (llguidance's / xgrammar's layout); other rows are untouched."""
    checks.check_grammar_mask(logits, bitmask, rows)
    triton = _use_triton(logits)
    on_host = logits.device.type == bitmask.device.type == "cpu" and (rows is None or rows.device.type == "cpu")
    if not triton and on_host:
        apply_grammar_mask_host(logits, bitmask, rows)
        return
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device)
    if triton:
        _triton_fn("grammar_mask_triton", "apply_grammar_mask_triton")(logits, bitmask, rows)
    else:
        apply_grammar_mask_ref(logits, bitmask, rows)


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: each expert's gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32 routing weights
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64 experts, in [0, num_experts)
    w13_scale: torch.Tensor | None = None,  # [num_experts, 2 * intermediate] fp32, fp8 weights only
    w2_scale: torch.Tensor | None = None,  # [num_experts, hidden] fp32, fp8 weights only
    *,
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate] in x's dtype (gpt-oss)
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: str = "silu",  # or "swiglu_oai": gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """SwiGLU mixture-of-experts FFN: ``sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, k]``; returns ``[num_tokens, hidden]`` in x's dtype.

    Triton on CUDA: slots sorted by expert on the device, one grouped GEMM launch per projection,
    no host read (CUDA-graph safe). Elsewhere the torch reference, which runs only the experts
    that got tokens. fp8 (e4m3) weights carry per-output-channel scales and are dequantized as
    they load (activations stay in x's dtype). gpt-oss: per-expert biases after each projection and
    its clamped SwiGLU gate (``activation="swiglu_oai"``, ``swiglu_alpha`` / ``swiglu_limit``)."""
    checks.check_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    checks.check_moe_extras(x, w13, w2, w13_bias, w2_bias, activation)
    extras = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, swiglu_alpha=swiglu_alpha,
                  swiglu_limit=swiglu_limit)
    if _use_triton(x):
        return _triton_fn("moe_triton", "fused_moe_triton")(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                                            **extras)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, **extras)


def lora_plan(
    slot_ids: torch.Tensor,  # [num_tokens] int32: each token's adapter slot, -1 = none
    num_slots: int,
) -> LoRAPlan:
    """Group a step's tokens by adapter slot, once per step, for every ``lora_shrink`` /
    ``lora_expand`` of the step. Triton: sorted and padded to blocks on the device (no host read,
    CUDA-graph safe); elsewhere the reference reads the slots present once."""
    checks.check_lora_plan(slot_ids, num_slots)
    if _use_triton(slot_ids):
        return _triton_fn("lora_triton", "lora_plan_triton")(slot_ids, num_slots)
    return lora_plan_ref(slot_ids, num_slots)


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    a: torch.Tensor,  # [num_slots, rank_rows, in_features]: each slot's A rows (parts stacked)
    plan: LoRAPlan,
) -> torch.Tensor:
    """``h[t] = a[slot[t]] @ x[t]`` -> ``[num_tokens, rank_rows]`` in x's dtype; rows of tokens
    without an adapter are unspecified (``lora_expand`` never reads them)."""
    checks.check_lora_shrink(x, a, plan.slot_ids)
    if plan.align is not None:
        return _triton_fn("lora_triton", "lora_shrink_triton")(x, a, plan)
    return lora_shrink_ref(x, a, plan)


def lora_expand(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    h: torch.Tensor,  # [num_tokens, len(slice_starts) * rank]
    b: torch.Tensor,  # [num_slots, out_features, rank]: each slot's B (scaling folded in)
    plan: LoRAPlan,
    slice_starts: tuple[int, ...] = (0,),  # output column where each part of a fused projection starts
) -> None:
    """``y[t, slice i] += b[slot[t], slice i] @ h[t, i*rank:(i+1)*rank]`` for tokens with an
    adapter; the others' rows of ``y`` are untouched. ``rank`` is a power of two >= 16."""
    checks.check_lora_expand(y, h, b, plan.slot_ids, slice_starts)
    if plan.align is not None:
        _triton_fn("lora_triton", "lora_expand_triton")(y, h, b, plan, slice_starts)
    else:
        lora_expand_ref(y, h, b, plan, slice_starts)
