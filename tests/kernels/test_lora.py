"""Batched LoRA shrink/expand: the torch reference against a per-token loop, and the Triton
kernels (in the interpreter on CPU) against the reference, fp32 and fp16.

Slot mixes cover what a step holds: every token on one adapter, tokens without one (-1) between
tokens with one, slots that get no token, a single token; fused projections with one, two and
three slices of unequal widths (q, k, v).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.lora_ref import lora_plan_ref
from tests.kernels.conftest import HAS_TRITON

NUM_SLOTS = 4
RANK = 16


def _slots(kind: str, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "one_adapter":
        return torch.full((num_tokens,), 2, dtype=torch.int32)
    if kind == "none":
        return torch.full((num_tokens,), -1, dtype=torch.int32)
    if kind == "mixed":   # -1 and slots 0, 1, 3 interleaved; slot 2 gets nothing
        return torch.tensor([(-1, 0, 3, 1, 0, -1, 3)[i % 7] for i in range(num_tokens)], dtype=torch.int32)
    if kind == "sorted":  # slots in token order, as many tokens each (as many slots as divide evenly)
        slots = next(s for s in (NUM_SLOTS, 2, 1) if num_tokens % s == 0)
        return (torch.arange(num_tokens) * slots // num_tokens).to(torch.int32)
    if kind == "skewed":  # a prefill chunk of slot 1 beside single tokens of slots 0 and 3, and -1
        return torch.tensor([0, 3, -1] + [1] * (num_tokens - 3), dtype=torch.int32)[:num_tokens]
    return torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=gen, dtype=torch.int32)


def _case(num_tokens, in_features, slices, kind, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(slices)
    x = torch.randn((num_tokens, in_features), generator=gen)
    a = torch.randn((NUM_SLOTS, len(slices) * RANK, in_features), generator=gen) / in_features ** 0.5
    b = torch.randn((NUM_SLOTS, n, RANK), generator=gen) / RANK ** 0.5
    y = torch.randn((num_tokens, n), generator=gen)
    slot_ids = _slots(kind, num_tokens, gen)
    starts = tuple(sum(slices[:i]) for i in range(len(slices)))
    return (*(t.to(dtype).to(device) for t in (x, a, b, y)), slot_ids.to(device), starts)


def _loop(x, a, b, y, slot_ids, starts):
    """Token by token, slice by slice: the plainest statement of the math (fp32)."""
    out = y.float().clone()
    bounds = (*starts, b.shape[1])
    for t, slot in enumerate(slot_ids.tolist()):
        if slot < 0:
            continue
        h = a[slot].float() @ x[t].float()                                   # [slices * r]
        for i in range(len(starts)):
            lo, hi = bounds[i], bounds[i + 1]
            out[t, lo:hi] += b[slot, lo:hi].float() @ h[i * RANK:(i + 1) * RANK]
    return out


KINDS = ["one_adapter", "mixed", "random", "none"]
# The reference's layouts: one slot in place; padded to one width and batched (mixed, random), in
# token order and added in place (sorted); packed runs, one matmul pair per slot (skewed).
REF_KINDS = [*KINDS, "sorted", "skewed"]
SLICES = [(48,), (40, 40), (64, 32, 32)]


@pytest.mark.parametrize("kind", REF_KINDS)
@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("num_tokens", [1, 13, 70])
def test_reference_equals_a_per_token_loop(torch_backend, kind, slices, num_tokens):
    x, a, b, y, slot_ids, starts = _case(num_tokens, 40, slices, kind, torch.float32, "cpu")
    expected = _loop(x, a, b, y, slot_ids, starts)
    plan = kernels.lora_plan(slot_ids, NUM_SLOTS)
    h = kernels.lora_shrink(x, a, plan)
    kernels.lora_expand(y, h, b, plan, starts)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_reference_plan_groups_tokens_by_slot():
    lone = lora_plan_ref(torch.full((5,), 3, dtype=torch.int32), NUM_SLOTS).groups
    assert (lone.slots, lone.rows, lone.positions) == ((3,), None, None)      # all rows, no gather
    mixed = lora_plan_ref(torch.tensor([-1, 1, 1, -1], dtype=torch.int32), NUM_SLOTS).groups
    assert (mixed.rows.tolist(), mixed.width, mixed.zero) == ([1, 2, 1], 3, 2)  # padded: the zeroed position
    assert mixed.positions.tolist() == [2, 0, 1, 2]
    decode = lora_plan_ref(torch.tensor([2, 0, 1, 0, 2, 1], dtype=torch.int32), NUM_SLOTS).groups
    assert (decode.slots, decode.index, decode.width, decode.zero) == ((0, 1, 2), None, 2, -1)  # one bmm, a view
    assert decode.rows.tolist() == [1, 3, 2, 5, 0, 4]
    skewed = lora_plan_ref(torch.tensor([0, 3, 1, 1, 1, 1, 1], dtype=torch.int32), NUM_SLOTS).groups
    assert (skewed.width, skewed.runs, skewed.index.tolist()) == (0, ((0, 1), (1, 5), (6, 1)), [0, 1, 3])


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("num_tokens", [1, 19, 70])
def test_triton_equals_reference_fp32(triton_backend, kind, slices, num_tokens):
    device = triton_backend
    x, a, b, y, slot_ids, starts = _case(num_tokens, 48, slices, kind, torch.float32, device, seed=num_tokens)
    expected = _loop(x.cpu(), a.cpu(), b.cpu(), y.cpu(), slot_ids.cpu(), starts)
    plan = kernels.lora_plan(slot_ids, NUM_SLOTS)
    assert plan.align is not None                       # the device plan, not the reference's
    h = kernels.lora_shrink(x, a, plan)
    kernels.lora_expand(y, h, b, plan, starts)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("kind", ["mixed", "one_adapter"])
def test_triton_equals_reference_fp16(triton_backend, kind):
    device = triton_backend
    x, a, b, y, slot_ids, starts = _case(37, 64, (64, 32, 32), kind, torch.float16, device, seed=3)
    y_ref = y.cpu().clone()
    ref_plan = lora_plan_ref(slot_ids.cpu(), NUM_SLOTS)
    kernels.lora_expand(y_ref, kernels.lora_shrink(x.cpu(), a.cpu(), ref_plan), b.cpu(), ref_plan, starts)
    plan = kernels.lora_plan(slot_ids, NUM_SLOTS)
    kernels.lora_expand(y, kernels.lora_shrink(x, a, plan), b, plan, starts)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), rtol=2e-2, atol=2e-2)


@needs_triton
def test_triton_leaves_rows_without_an_adapter_untouched(triton_backend):
    device = triton_backend
    x, a, b, y, slot_ids, starts = _case(21, 32, (32, 16), "mixed", torch.float32, device)
    before = y.clone()
    plan = kernels.lora_plan(slot_ids, NUM_SLOTS)
    kernels.lora_expand(y, kernels.lora_shrink(x, a, plan), b, plan, starts)
    none = slot_ids == -1
    assert torch.equal(y[none], before[none])
    assert not torch.equal(y[~none], before[~none])


@pytest.mark.parametrize("bad", ["rank", "slices", "dtype", "tokens"])
def test_launchers_refuse_mismatched_inputs(bad):
    x, a, b, y, slot_ids, starts = _case(4, 32, (32, 16), "mixed", torch.float32, "cpu")
    plan = lora_plan_ref(slot_ids, NUM_SLOTS)
    h = kernels.lora_shrink(x, a, plan)
    if bad == "rank":
        with pytest.raises(ValueError, match="power of two"):
            kernels.lora_expand(y, h[:, :24], b[:, :, :12], plan, starts)
    elif bad == "slices":
        with pytest.raises(ValueError, match="slice_starts"):
            kernels.lora_expand(y, h, b, plan, (16, 0))
    elif bad == "dtype":
        with pytest.raises(ValueError, match="dtype"):
            kernels.lora_shrink(x.half(), a, plan)
    else:
        with pytest.raises(ValueError, match="tokens"):
            kernels.lora_shrink(x[:3], a, plan)
    with pytest.raises(ValueError, match="int32"):
        kernels.lora_plan(slot_ids.long(), NUM_SLOTS)
