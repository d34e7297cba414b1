"""Boundary checks shared by both backends: shapes and dtypes, with clear errors.

The public functions in ``kernels`` call these once per call, ~60 times per model step, so each
check is one boolean expression over shapes and dtypes read once each (no device syncs, no
formatting); only when it fails does the matching ``_explain_*`` walk the inputs again to raise
the precise message. Devices are not compared on this path: a CPU tensor handed to a Triton
launcher is rejected by Triton itself, and the torch reference raises on mixed devices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOATS = frozenset(FLOAT_DTYPES)
# An fp8 KV cache holds K / k_scale and V / v_scale in e4m3 (per-tensor scales, one pair per layer):
# writes quantize, reads dequantize. Any float query dtype may use one.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn   # fp8 expert weights (per-channel scales) of fused_moe
_I32, _I64 = torch.int32, torch.int64


class PagedAttentionSizes(NamedTuple):
    """The sizes of one ``paged_attention`` call, read from shapes alone (never syncs)."""

    num_tokens: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    block_size: int
    num_seqs: int
    max_context: int  # block-table width x block size: the most keys any sequence can hold

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads


def paged_attention_sizes(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
) -> PagedAttentionSizes:
    """Sizes the attention launchers derive from their inputs; assumes the ranks are right.

    ``check_paged_attention`` returns the same value; launchers take it as an argument and call
    this only when used directly (tests, benchmarks)."""
    qs, ks, bs = q.shape, key_cache.shape, block_tables.shape
    return PagedAttentionSizes(qs[0], qs[1], qs[2], ks[2], ks[1], bs[0], bs[1] * ks[1])


def check_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> PagedAttentionSizes:
    """Validate the inputs of ``paged_attention`` (see docs/architecture.md, "kernels"); return their sizes."""
    qs, ks, bs = q.shape, key_cache.shape, block_tables.shape
    if not (sliding_window >= 0 and (sinks is None or (sinks.shape == qs[1:2] and sinks.dtype in _FLOATS))):
        _explain_window_and_sinks(q, sliding_window, sinks)
    if len(qs) == 3 and len(ks) == 4 and len(bs) == 2:
        num_heads, head_dim, num_kv_heads, num_seqs = qs[1], qs[2], ks[2], bs[0]
        dtype, kv_dtype = q.dtype, key_cache.dtype
        if (ks[3] == head_dim and value_cache.shape == ks and num_kv_heads > 0 and num_heads % num_kv_heads == 0
                and dtype in _FLOATS and (kv_dtype is dtype or kv_dtype is FP8_KV_DTYPE)
                and value_cache.dtype is kv_dtype
                and block_tables.dtype is _I32 and seq_lens.dtype is _I32 and query_start_loc.dtype is _I32
                and seq_lens.shape == (num_seqs,) and query_start_loc.shape == (num_seqs + 1,)):
            return PagedAttentionSizes(qs[0], num_heads, head_dim, num_kv_heads, ks[1], num_seqs, bs[1] * ks[1])
    _explain_paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    raise AssertionError("unreachable: _explain_paged_attention raises")


def _explain_window_and_sinks(q, sliding_window, sinks) -> None:
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {sliding_window}")
    raise ValueError(f"sinks must be one float per query head, [{q.shape[1]}], got "
                     f"{sinks.dtype} {tuple(sinks.shape)}")


def _explain_paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)}")
    if not (block_tables.dim() == 2 and block_tables.dtype == torch.int32):
        raise ValueError(f"block_tables must be 2-D int32, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    sizes = paged_attention_sizes(q, key_cache, block_tables)
    if key_cache.shape[3] != sizes.head_dim:
        raise ValueError(f"head_dim mismatch: q has {sizes.head_dim}, key_cache has {key_cache.shape[3]}")
    if not (sizes.num_kv_heads > 0 and sizes.num_heads % sizes.num_kv_heads == 0):
        raise ValueError(f"num_heads ({sizes.num_heads}) must be a multiple of num_kv_heads ({sizes.num_kv_heads})")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not in {FLOAT_DTYPES}")
    if not (key_cache.dtype in (q.dtype, FP8_KV_DTYPE) and value_cache.dtype == key_cache.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype} "
                         f"(the caches must both be q's dtype or both {FP8_KV_DTYPE})")
    num_seqs = sizes.num_seqs
    if not (seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32):
        raise ValueError(f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}], got "
                     f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate the inputs of ``write_kv``."""
    ks, cs = key.shape, key_cache.shape
    dtype, kv_dtype = key.dtype, key_cache.dtype
    if (len(ks) == 3 and len(cs) == 4 and value.shape == ks and value_cache.shape == cs
            and cs[2] == ks[1] and cs[3] == ks[2] and slot_mapping.dtype is _I64 and slot_mapping.shape == ks[:1]
            and value.dtype is dtype and (kv_dtype is dtype or (kv_dtype is FP8_KV_DTYPE and dtype in _FLOATS))
            and value_cache.dtype is kv_dtype):
        return
    _explain_write_kv(key, value, key_cache, value_cache, slot_mapping)


def _explain_write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    if not (key.dim() == 3 and value.shape == key.shape):
        raise ValueError(f"key/value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if not (key_cache.dim() == 4 and value_cache.shape == key_cache.shape):
        raise ValueError(f"caches must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key {tuple(key.shape[1:])}")
    if not (slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype == torch.int64):
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    raise ValueError(f"dtype mismatch: key {key.dtype}, value {value.dtype}, "
                     f"caches {key_cache.dtype}/{value_cache.dtype} (both key's dtype or both {FP8_KV_DTYPE})")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """Validate the inputs of ``rms_norm`` / ``fused_add_rms_norm``."""
    xs = x.shape
    if (len(xs) >= 1 and xs[-1] > 0 and weight.shape == xs[-1:] and x.dtype in _FLOATS and weight.dtype in _FLOATS
            and (residual is None or (residual.shape == xs and residual.dtype is x.dtype))):
        return
    if not (x.dim() >= 1 and x.shape[-1] > 0):
        raise ValueError(f"x must have a non-empty last dim, got {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if not (x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES):
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must be floating point")
    raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match "  # type: ignore[union-attr]
                     f"x {x.dtype} {tuple(x.shape)}")


def check_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Validate the inputs of ``apply_rope``."""
    qs, ks, cs = q.shape, k.shape, cos_sin_cache.shape
    if len(qs) == 3 and len(ks) == 3 and len(cs) == 2:
        rotary_dim, head_dim, dtype = cs[1], qs[2], q.dtype
        if (ks[0] == qs[0] and ks[2] == head_dim and positions.dtype is _I64 and positions.shape == qs[:1]
                and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim and k.dtype is dtype and dtype in _FLOATS
                and cos_sin_cache.dtype in _FLOATS):
            return
    if not (q.dim() == 3 and k.dim() == 3):
        raise ValueError(f"q/k must be [num_tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    if not (q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on num_tokens or head_dim")
    if not (positions.shape == (q.shape[0],) and positions.dtype == torch.int64):
        raise ValueError(f"positions must be int64 [{q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim], got "
                         f"{tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    if not (rotary_dim % 2 == 0 and 0 < rotary_dim <= q.shape[2]):
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {q.shape[2]}")
    if not (q.dtype == k.dtype and q.dtype in FLOAT_DTYPES):
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) dtype mismatch")
    raise ValueError(f"cos_sin_cache dtype {cos_sin_cache.dtype} not floating")


def check_silu_and_mul(x: torch.Tensor) -> None:
    """Validate the input of ``silu_and_mul``: ``[num_tokens, 2 * intermediate]`` floating point."""
    xs = x.shape
    if len(xs) == 2 and xs[1] % 2 == 0 and x.dtype in _FLOATS:
        return
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate_size], got {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x's last dim ({x.shape[1]}) must be even: the gate and up halves")
    raise ValueError(f"x dtype {x.dtype} not in {FLOAT_DTYPES}")


def check_quantize_fp8_rows(x: torch.Tensor, static_scale: torch.Tensor | None) -> None:
    """Validate the inputs of ``quantize_fp8_rows``: 2-D float rows, an optional one-element fp32 scale."""
    if (len(x.shape) == 2 and x.dtype in _FLOATS
            and (static_scale is None or (static_scale.numel() == 1 and static_scale.dtype is torch.float32))):
        return
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, features], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    raise ValueError(f"static_scale must be one fp32 value, got {static_scale.dtype} {tuple(static_scale.shape)}")


def check_grammar_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Validate the inputs of ``apply_grammar_mask``: 2-D float logits with unit column stride, a
    C-contiguous int32 ``[num_masks, words]`` bitmask and ``[num_masks]`` int64 row indices (or
    None, with no more masks than logits rows)."""
    if (len(logits.shape) == 2 and logits.dtype in _FLOATS and logits.stride(1) == 1
            and len(bitmask.shape) == 2 and bitmask.dtype is _I32 and bitmask.is_contiguous()
            and (rows.shape == (bitmask.shape[0],) and rows.dtype is _I64 if rows is not None
                 else bitmask.shape[0] <= logits.shape[0])):
        return
    if logits.dim() != 2 or logits.dtype not in _FLOATS or logits.stride(1) != 1:
        raise ValueError(f"logits must be [num_seqs, vocab] floating point with unit column stride, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    if bitmask.dim() != 2 or bitmask.dtype is not _I32 or not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be contiguous int32 [num_masks, words], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if rows is None:
        raise ValueError(f"rows None needs at most {logits.shape[0]} masks, got {bitmask.shape[0]}")
    raise ValueError(f"rows must be int64 [{bitmask.shape[0]}], got {rows.dtype} {tuple(rows.shape)}")


def check_moe_extras(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                     w2_bias: torch.Tensor | None, activation: str) -> None:
    """Validate gpt-oss's options of ``fused_moe``: biases ``[E, 2I]`` / ``[E, H]`` in x's dtype
    (both or neither) and the activation's name."""
    if ((w13_bias is None) == (w2_bias is None) and activation in ("silu", "swiglu_oai")
            and (w13_bias is None or (w13_bias.shape == w13.shape[:2] and w2_bias.shape == w2.shape[:2]
                                      and w13_bias.dtype is x.dtype and w2_bias.dtype is x.dtype))):
        return
    if activation not in ("silu", "swiglu_oai"):
        raise ValueError(f"activation must be 'silu' or 'swiglu_oai', got {activation!r}")
    raise ValueError(f"expert biases must both be given, {x.dtype} [{w13.shape[0]}, {w13.shape[1]}] and "
                     f"[{w2.shape[0]}, {w2.shape[1]}]; got {None if w13_bias is None else tuple(w13_bias.shape)} "
                     f"and {None if w2_bias is None else tuple(w2_bias.shape)}")


def check_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> None:
    """Validate the inputs of ``fused_moe``: ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in
    x's dtype (or float8_e4m3fn with fp32 ``w13_scale [E, 2I]`` / ``w2_scale [E, H]``), fp32
    ``topk_weights`` and int32/int64 ``topk_ids``, both ``[T, K]`` with ``K <= E``. The ids'
    values (in ``[0, E)``) are not checked: that would read them back from the device."""
    xs, ws, ds, ks = x.shape, w13.shape, w2.shape, topk_ids.shape
    fp8 = w13.dtype is FP8_WEIGHT_DTYPE
    if (len(xs) == 2 and len(ws) == 3 and len(ds) == 3 and len(ks) == 2 and x.dtype in _FLOATS
            and ws[2] == xs[1] and ws[1] % 2 == 0 and ds == (ws[0], xs[1], ws[1] // 2)
            and (w13.dtype is x.dtype or fp8) and w2.dtype is w13.dtype
            and ks[0] == xs[0] and 0 < ks[1] <= ws[0] and topk_ids.dtype in (_I32, _I64)
            and topk_weights.shape == ks and topk_weights.dtype is torch.float32
            and (w13_scale is None) == (w2_scale is None) == (not fp8)
            and (not fp8 or (w13_scale.shape == ws[:2] and w2_scale.shape == ds[:2]
                             and w13_scale.dtype is torch.float32 and w2_scale.dtype is torch.float32))):
        return
    if not (x.dim() == 2 and x.dtype in FLOAT_DTYPES):
        raise ValueError(f"x must be [num_tokens, hidden] floating point, got {x.dtype} {tuple(x.shape)}")
    if not (w13.dim() == 3 and w13.shape[2] == x.shape[1] and w13.shape[1] % 2 == 0):
        raise ValueError(f"w13 must be [num_experts, 2 * intermediate, {x.shape[1]}], got {tuple(w13.shape)}")
    if w2.shape != (w13.shape[0], x.shape[1], w13.shape[1] // 2):
        raise ValueError(f"w2 must be [{w13.shape[0]}, {x.shape[1]}, {w13.shape[1] // 2}], got {tuple(w2.shape)}")
    if not (w2.dtype is w13.dtype and w13.dtype in (x.dtype, FP8_WEIGHT_DTYPE)):
        raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must both be x's dtype ({x.dtype}) or {FP8_WEIGHT_DTYPE}")
    if not (topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and 0 < topk_ids.shape[1] <= w13.shape[0]
            and topk_ids.dtype in (_I32, _I64)):
        raise ValueError(f"topk_ids must be int32/int64 [{x.shape[0]}, top_k <= {w13.shape[0]}], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if not (topk_weights.shape == topk_ids.shape and topk_weights.dtype is torch.float32):
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    raise ValueError(f"fp8 experts need float32 w13_scale {tuple(w13.shape[:2])} and w2_scale {tuple(w2.shape[:2])} "
                     f"(per output channel); other dtypes take none")


def check_lora_plan(slot_ids: torch.Tensor, num_slots: int) -> None:
    """Validate the input of ``lora_plan``: int32 ``slot_ids [T]`` (-1 or a slot in ``[0, num_slots)``,
    values not checked: that would read them back), ``num_slots >= 1``."""
    if len(slot_ids.shape) == 1 and slot_ids.dtype is _I32 and num_slots >= 1:
        return
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    raise ValueError(f"slot_ids must be int32 [num_tokens], got {slot_ids.dtype} {tuple(slot_ids.shape)}")


def check_lora_shrink(x: torch.Tensor, a: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """Validate the inputs of ``lora_shrink``: ``x [T, K]`` floating point, ``a [S, R, K]`` in x's
    dtype with unit stride along K, one slot id per row of x."""
    xs, as_ = x.shape, a.shape
    if (len(xs) == 2 and len(as_) == 3 and as_[2] == xs[1] and a.dtype is x.dtype and x.dtype in _FLOATS
            and a.stride(2) == 1 and slot_ids.shape[0] == xs[0]):
        return
    if not (x.dim() == 2 and x.dtype in FLOAT_DTYPES):
        raise ValueError(f"x must be [num_tokens, in_features] floating point, got {x.dtype} {tuple(x.shape)}")
    if not (a.dim() == 3 and a.shape[2] == x.shape[1] and a.stride(2) == 1):
        raise ValueError(f"a must be [num_slots, rank, {x.shape[1]}] with unit stride along its last dim, got "
                         f"{tuple(a.shape)} strides {a.stride()}")
    if a.dtype is not x.dtype:
        raise ValueError(f"a ({a.dtype}) must have x's dtype ({x.dtype})")
    raise ValueError(f"the plan has {slot_ids.shape[0]} tokens, x has {x.shape[0]}")


def check_lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor,
                      slice_starts: tuple[int, ...]) -> None:
    """Validate the inputs of ``lora_expand``: ``y [T, N]`` (unit column stride), ``h [T, n * r]`` and
    ``b [S, N, r]`` all of one float dtype, ``r`` a power of two >= 16, 1 to 3 increasing
    ``slice_starts`` from 0 below N."""
    ys, hs, bs = y.shape, h.shape, b.shape
    n = len(slice_starts)
    if (len(ys) == 2 and len(hs) == 2 and len(bs) == 3 and hs[0] == ys[0] == slot_ids.shape[0]
            and bs[1] == ys[1] and hs[1] == n * bs[2] and y.dtype is h.dtype is b.dtype and y.dtype in _FLOATS
            and y.stride(1) == 1 and bs[2] >= 16 and bs[2] & (bs[2] - 1) == 0 and 1 <= n <= 3
            and slice_starts[0] == 0 and all(slice_starts[i] < slice_starts[i + 1] for i in range(n - 1))
            and slice_starts[-1] < ys[1]):
        return
    if not (y.dim() == 2 and h.dim() == 2 and b.dim() == 3):
        raise ValueError(f"y must be [T, N], h [T, slices * rank], b [num_slots, N, rank]; got {tuple(ys)}, "
                         f"{tuple(hs)}, {tuple(bs)}")
    if not (y.dtype is h.dtype is b.dtype and y.dtype in FLOAT_DTYPES):
        raise ValueError(f"y ({y.dtype}), h ({h.dtype}) and b ({b.dtype}) must share one float dtype")
    if not (bs[2] >= 16 and bs[2] & (bs[2] - 1) == 0):
        raise ValueError(f"b's rank dim ({bs[2]}) must be a power of two >= 16 (pad the adapter's rank)")
    if not (1 <= n <= 3 and slice_starts[0] == 0 and all(slice_starts[i] < slice_starts[i + 1] for i in range(n - 1))
            and slice_starts[-1] < ys[1]):
        raise ValueError(f"slice_starts must be 1 to 3 increasing column offsets from 0 below {ys[1]}, got "
                         f"{slice_starts}")
    if y.stride(1) != 1:
        raise ValueError(f"y must have unit column stride, got strides {y.stride()}")
    raise ValueError(f"shapes disagree: y {tuple(ys)}, h {tuple(hs)} (must be [T, {n} * {bs[2]}]), "
                     f"b {tuple(bs)}, {slot_ids.shape[0]} planned tokens")
