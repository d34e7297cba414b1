"""Triton batched LoRA: segmented shrink and expand (Punica's SGMV, vLLM's v1 ``lora_shrink`` /
``lora_expand``) over tokens grouped by adapter slot on the device.

Plan (once per step, ``lora_plan_triton``): the step's tokens are sorted by slot and each slot's
run padded to whole ``BLOCK_M`` blocks by the MoE alignment step (``moe_align``: every token is
routed to one "expert", its slot, and tokens without an adapter to an extra group that no program
computes). Shapes depend only on the token count and the number of slots, and nothing is read
back to the host, so a decode step with adapters captures into a CUDA graph.

Then every LoRA projection is two launches:

1. shrink: a ``[BLOCK_M, BLOCK_N]`` tile of ``h = x @ A[slot].T`` per program, over one block of
   one slot, reducing over ``K`` (the projection's input features) in ``BLOCK_K`` steps;
2. expand: ``y[:, cols] += h[:, slice] @ B[slot, cols].T`` per program, the third grid axis
   being the slice (the q, k, v parts of a fused projection each read their own ``R_PAD``
   columns of ``h``); each output element is owned by one program, so the add needs no atomics.

Blocks of the no-adapter group and programs past the device-side padded length return at once.
Each slot's weights are read once per tile column per block of its tokens, not once per token.
``h`` is kept in x's dtype, as the reference keeps it; both matmuls accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_ref import LoRAPlan
from kernels.moe_align import moe_align_block_size


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_shrink_kernel(
    h_ptr,  # [T, R] out
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    sorted_ptr,  # [max_padded] int32 token rows, sentinel T
    block_slot_ptr,  # [max_padded // BLOCK_M] int32, num_slots = no adapter
    num_padded_ptr,  # [1] int32
    num_tokens, num_slots, R, K,
    stride_hm, stride_xm, stride_as, stride_ar, stride_ak,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m)
    if slot >= num_slots:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    valid = rows < num_tokens
    rows = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)                                                              # [BM, BK]
        w = tl.load(a_base + offs_k[:, None] * stride_ak + offs_n[None, :] * stride_ar,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)                         # [BK, BN]
        if IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(out, acc.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_expand_kernel(
    y_ptr,  # [T, N] in/out
    h_ptr,  # [T, num_slices * R_PAD]
    b_ptr,  # [S, N, R_PAD]
    sorted_ptr, block_slot_ptr, num_padded_ptr,
    num_tokens, num_slots, N, start1, start2,
    stride_ym, stride_hm, stride_bs, stride_bn, stride_br,
    NUM_SLICES: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slot_ptr + pid_m)
    if slot >= num_slots:
        return
    # Slice pid_s covers output columns [lo, hi): cut at start1 (and start2) of a fused projection.
    lo = tl.where(pid_s == 0, 0, tl.where(pid_s == 1, start1, start2))
    hi = N
    if NUM_SLICES > 1:
        hi = tl.where(pid_s == NUM_SLICES - 1, N, tl.where(pid_s == 0, start1, start2))
    col0 = lo + pid_n * BLOCK_N
    if col0 >= hi:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    valid = rows < num_tokens
    rows = rows.to(tl.int64)
    cols = col0 + tl.arange(0, BLOCK_N)
    c_ok = cols < hi
    offs_r = tl.arange(0, R_PAD)
    hv = tl.load(h_ptr + rows[:, None] * stride_hm + (pid_s * R_PAD + offs_r)[None, :], mask=valid[:, None],
                 other=0.0)                                                                 # [BM, R_PAD]
    w = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + cols[None, :] * stride_bn,
                mask=c_ok[None, :], other=0.0).to(hv.dtype)                                 # [R_PAD, BN]
    if IEEE_FP32:
        acc = tl.dot(hv, w, input_precision="ieee")
    else:
        acc = tl.dot(hv, w)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = valid[:, None] & c_ok[None, :]
    prev = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (prev + acc).to(y_ptr.dtype.element_ty), mask=mask)


def block_m_for(num_tokens: int) -> int:
    """Rows per block: small for decode steps (a few tokens per adapter), larger for prefill
    chunks. Untuned defaults; the choice depends on the token count alone (CUDA graphs)."""
    return 16 if num_tokens <= 64 else 32 if num_tokens <= 512 else 64


def _tile(size: int, most: int) -> int:
    # A power of two in [16, most] (tl.dot needs >= 16).
    return max(16, min(most, triton.next_power_of_2(size)))


def lora_plan_triton(slot_ids: torch.Tensor, num_slots: int) -> LoRAPlan:
    """Sort the step's tokens by slot on the device (``moe_align``); no host read."""
    block_m = block_m_for(slot_ids.shape[0])
    groups = torch.where(slot_ids < 0, num_slots, slot_ids).view(-1, 1)      # -1 -> the extra group
    align = moe_align_block_size(groups, block_m, num_slots + 1)
    return LoRAPlan(slot_ids, num_slots, align=align, block_m=block_m)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan) -> torch.Tensor:
    """``h [T, R]`` in x's dtype (inputs validated by ``kernels.checks``)."""
    num_tokens, k = x.shape
    r = a.shape[1]
    h = x.new_empty((num_tokens, r))
    if num_tokens == 0:
        return h
    x = x if x.stride(1) == 1 else x.contiguous()
    sorted_rows, block_slots, num_padded = plan.align
    block_n = _tile(r, 64)
    grid = (block_slots.shape[0], triton.cdiv(r, block_n))
    _lora_shrink_kernel[grid](
        h, x, a, sorted_rows, block_slots, num_padded, num_tokens, plan.num_slots, r, k,
        h.stride(0), x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        IEEE_FP32=x.dtype == torch.float32, BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=_tile(k, 64),
        num_warps=4,
    )
    return h


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
                       slice_starts: tuple[int, ...]) -> None:
    """``y += ...`` in place (inputs validated by ``kernels.checks``)."""
    num_tokens, n = y.shape
    if num_tokens == 0:
        return
    num_slices = len(slice_starts)
    bounds = (*slice_starts, n)
    widest = max(bounds[i + 1] - bounds[i] for i in range(num_slices))
    block_n = _tile(widest, 64)
    starts = (*slice_starts[1:], 0, 0)
    sorted_rows, block_slots, num_padded = plan.align
    grid = (block_slots.shape[0], triton.cdiv(widest, block_n), num_slices)
    _lora_expand_kernel[grid](
        y, h, b, sorted_rows, block_slots, num_padded, num_tokens, plan.num_slots, n, starts[0], starts[1],
        y.stride(0), h.stride(0), b.stride(0), b.stride(1), b.stride(2),
        NUM_SLICES=num_slices, IEEE_FP32=h.dtype == torch.float32, R_PAD=b.shape[2], BLOCK_M=plan.block_m,
        BLOCK_N=block_n, num_warps=4,
    )
