"""Reference for `kernels.apply_grammar_mask`: a structured-output token mask on the logits."""

from __future__ import annotations

import torch


def apply_grammar_mask_ref(
    logits: torch.Tensor,  # [num_seqs, vocab] float, written in place
    bitmask: torch.Tensor,  # [num_masks, words] int32: bit t % 32 of word t // 32 = token t allowed
    rows: torch.Tensor,  # [num_masks] int64: the logits row each mask applies to (distinct)
) -> None:
    """Set `logits[rows[j], t] = -inf` wherever bit `t` of `bitmask[j]` is 0 or `t >= 32 * words`;
    rows not named are untouched."""
    num_masks, words = bitmask.shape
    if num_masks == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(num_masks, words * 32)   # [num_masks, 32 * words]
    allowed = torch.zeros(num_masks, vocab, dtype=torch.bool, device=logits.device)
    width = min(vocab, words * 32)
    allowed[:, :width] = bits[:, :width].bool()
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))
