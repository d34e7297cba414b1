"""Triton structured-output mask: one program per (mask, block of the vocabulary).

The bitmask is llguidance's and xgrammar's layout (packed int32 words, LSB first, bit 1 =
allowed). A program reads its block's words (each lane the word of its token) and writes -inf to
the masked tokens only: the logits are never read, so the pass costs the bitmask's bytes plus one
store per forbidden token. Rows without a grammar are not in the grid at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048   # tokens per program (a multiple of 32: whole words)


@triton.jit
def _grammar_mask_kernel(
    logits_ptr,  # [num_seqs, vocab] float
    bitmask_ptr,  # [num_masks, words] int32
    rows_ptr,  # [num_masks] int64
    vocab,
    words,
    stride_logits,
    stride_mask,
    BLOCK: tl.constexpr,
):
    mask_index = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + mask_index).to(tl.int64)
    word = offs // 32
    in_vocab = offs < vocab
    packed = tl.load(bitmask_ptr + mask_index.to(tl.int64) * stride_mask + word,
                     mask=in_vocab & (word < words), other=0)
    allowed = ((packed >> (offs % 32)) & 1) != 0
    minus_inf = tl.full((BLOCK,), float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, minus_inf, mask=in_vocab & ~allowed)


def apply_grammar_mask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place (inputs already validated by ``kernels.checks``)."""
    num_masks, words = bitmask.shape
    vocab = logits.shape[1]
    if num_masks == 0 or vocab == 0:
        return
    _grammar_mask_kernel[(num_masks, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, rows, vocab, words, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
