"""The structured-output mask (`kernels.apply_grammar_mask`): the reference and the host path
against llguidance's own bit order, Triton (interpreted on CPU) against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels.grammar_mask_host import apply_grammar_bounds, apply_grammar_mask_host, grammar_mask_bounds
from kernels.grammar_mask_ref import apply_grammar_mask_ref

IMPLEMENTATIONS = pytest.mark.parametrize("apply", [apply_grammar_mask_ref, apply_grammar_mask_host],
                                          ids=["ref", "host"])


def _bitmask(allowed: list[list[int]], words: int) -> torch.Tensor:
    """Pack lists of allowed ids into int32 words, LSB first."""
    bits = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for j, ids in enumerate(allowed):
        bits[j, ids] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def _cases(seed: int, num_seqs: int, vocab: int, words: int):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    logits = torch.randn(num_seqs, vocab, generator=gen)
    rows = torch.tensor(sorted(rng.choice(num_seqs, size=min(3, num_seqs), replace=False)), dtype=torch.int64)
    limit = min(vocab, words * 32)
    allowed = [list(range(limit)),                                   # all allowed
               [int(rng.integers(limit))],                            # one allowed
               sorted(rng.choice(limit, size=limit // 3, replace=False).tolist())][:len(rows)]
    return logits, _bitmask(allowed, words), rows, allowed


@IMPLEMENTATIONS
def test_reference_follows_llguidance_bit_order(apply):
    llg_numpy = pytest.importorskip("llguidance.numpy")
    logits, bitmask, rows, _ = _cases(0, 5, 77, 3)     # 77: not a multiple of 32
    ours = logits.clone()
    apply(ours, bitmask, rows)
    theirs = logits.numpy().copy()
    selected = theirs[rows.numpy()]
    llg_numpy.apply_token_bitmask_inplace(selected, bitmask.numpy())
    theirs[rows.numpy()] = selected
    assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("vocab, words", [(77, 3), (64, 2), (100, 2), (5000, 157)])
def test_reference_masks_exactly_the_forbidden_and_padded_tokens(vocab, words):
    """(100, 2): logits wider than the bitmask: the ids past it are always masked."""
    logits, bitmask, rows, allowed = _cases(1, 6, vocab, words)
    out = logits.clone()
    apply_grammar_mask_ref(out, bitmask, rows)
    for j, row in enumerate(rows.tolist()):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[allowed[j]] = True
        assert torch.equal(out[row][keep], logits[row][keep])
        assert bool((out[row][~keep] == float("-inf")).all())
    untouched = [r for r in range(6) if r not in rows.tolist()]
    assert torch.equal(out[untouched], logits[untouched])


@pytest.mark.parametrize("vocab, words, dtype", [(77, 3, torch.float32), (4099, 129, torch.float32),
                                                 (100, 2, torch.float16), (2048, 64, torch.float32)])
def test_triton_equals_reference(triton_backend, vocab, words, dtype):
    logits, bitmask, rows, _ = _cases(2, 7, vocab, words)
    logits = logits.to(dtype)
    want = logits.clone()
    apply_grammar_mask_ref(want, bitmask, rows)
    got = logits.to(triton_backend)
    kernels.apply_grammar_mask(got, bitmask.to(triton_backend), rows.to(triton_backend))
    assert torch.equal(got.cpu(), want)


def test_triton_strided_logits_and_no_masks(triton_backend):
    base = torch.randn(4, 300)
    logits = base[:, :250]                       # row stride 300, unit column stride
    bitmask = _bitmask([[1, 2, 249]], 8)
    want = logits.clone()
    apply_grammar_mask_ref(want, bitmask, torch.tensor([2]))
    got = logits.clone().to(triton_backend)
    kernels.apply_grammar_mask(got, bitmask.to(triton_backend), torch.tensor([2], device=triton_backend))
    assert torch.equal(got.cpu(), want)
    empty = torch.zeros(0, 8, dtype=torch.int32, device=triton_backend)
    kernels.apply_grammar_mask(got, empty, torch.zeros(0, dtype=torch.int64, device=triton_backend))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_path_equals_reference(dtype):
    """The launcher's CPU path, with masks on the first rows in order (`rows` None: in place, no
    gather; all rows or a prefix), in order and in another order as indices, and on some rows (a
    gather and a scatter)."""
    logits, bitmask, _, _ = _cases(3, 3, 100, 2)          # 100 > 64: padded ids masked too
    logits = logits.to(dtype)
    for masks, rows in ((bitmask, None), (bitmask[:2], None), (bitmask, torch.arange(3)),
                        (bitmask, torch.tensor([2, 0, 1]))):
        want, got = logits.clone(), logits.clone()
        apply_grammar_mask_ref(want, masks, torch.arange(len(masks)) if rows is None else rows)
        kernels.apply_grammar_mask(got, masks, rows)
        assert torch.equal(got, want)
    wide, some_masks, some_rows, _ = _cases(4, 6, 5000, 157)
    want, got = wide.clone(), wide.clone()
    apply_grammar_mask_ref(want, some_masks, some_rows)
    kernels.apply_grammar_mask(got, some_masks, some_rows)
    assert torch.equal(got, want) and not torch.equal(got, wide)


def test_launcher_refuses_bad_inputs():
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bitmask"):
        kernels.apply_grammar_mask(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows"):
        kernels.apply_grammar_mask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="logits"):
        kernels.apply_grammar_mask(logits.t(), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows None"):
        kernels.apply_grammar_mask(logits, torch.zeros(3, 2, dtype=torch.int32), None)


@pytest.mark.parametrize("vocab, words", [(77, 3), (64, 2), (260, 9), (5000, 157)])
def test_bounds_masked_by_one_minimum_equal_the_reference(vocab, words):
    """A CPU engine's path: `grammar_mask_bounds` (one table lookup, beside the forward), then
    `apply_grammar_bounds` on the first rows (all of them or a prefix, in place or as the
    sampler's copy) or on named rows."""
    logits, bitmask, some_rows, _ = _cases(5, 5, vocab, words)
    bounds = np.full((5, words * 32), 7.0, dtype=np.float32)
    grammar_mask_bounds(bitmask.numpy(), bounds[:len(bitmask)])
    bounds = torch.from_numpy(bounds)[:, :vocab]
    for num_masks, rows in ((len(bitmask), some_rows), (len(bitmask), None), (0, None)):
        want = logits.clone()
        apply_grammar_mask_ref(want, bitmask[:num_masks], torch.arange(num_masks) if rows is None else rows)
        for copy in (True, False):
            given = logits.clone()
            got = apply_grammar_bounds(given, bounds[:num_masks], rows, copy)
            assert torch.equal(got, want) and (got is given) is not copy
            assert not copy or torch.equal(given, logits)
    square = logits[:len(bitmask)]                      # every row masked: the minimum is the copy
    want = square.clone()
    apply_grammar_mask_ref(want, bitmask, torch.arange(len(bitmask)))
    assert torch.equal(apply_grammar_bounds(square, bounds[:len(bitmask)], None, True), want)
    strided = np.zeros((len(bitmask), words * 64), np.float32)[:, ::2]   # written through, never a copy
    grammar_mask_bounds(bitmask.numpy(), strided)
    assert np.array_equal(strided[:, :vocab], bounds[:len(bitmask)].numpy())
