"""`kernels.apply_grammar_mask` on host memory (the CPU path): the bitmask unpacked by numpy.

The torch reference (`grammar_mask_ref`) spells the bit order out in ~10 tensor ops; on a CPU
engine those run on the sampling step's critical path, once per step. Here one `np.unpackbits`
(LSB first, zero-padded past the bitmask's width, so padded ids stay masked) gives the allowed
tokens as a bool view, and one `masked_fill_` writes the -inf; when the masks cover every row in
order (100% structured traffic) it runs on the logits in place, with no gather or scatter.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_mask_host(
    logits: torch.Tensor,  # [num_seqs, vocab] float in host memory, written in place
    bitmask: torch.Tensor,  # [num_masks, words] int32 in host memory, LSB first, bit 1 = allowed
    rows: torch.Tensor,  # [num_masks] int64: the logits row of each mask (distinct)
) -> None:
    """The same result as `apply_grammar_mask_ref`."""
    num_masks = bitmask.shape[0]
    if num_masks == 0:
        return
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    forbidden = torch.from_numpy(bits).view(torch.bool).logical_not_()   # [num_masks, vocab]
    row_ids = rows.numpy()
    if num_masks == logits.shape[0] and (row_ids == np.arange(num_masks)).all():
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
