"""`kernels.apply_grammar_mask` on host memory (the CPU path): numpy on the tensors' memory.

The torch reference (`grammar_mask_ref`) spells the bit order out in ~10 tensor ops, and a
masked fill branches on every token (a mispredicted branch wherever allowed and forbidden tokens
alternate); on a CPU engine this runs on the sampling step's critical path, once per step. Here
the packed words are inverted (32x fewer elements than the tokens) and one `np.unpackbits` (LSB
first) gives 1 at each forbidden token; shifted into the sign bit of +inf's bit pattern that is
-inf where forbidden and +inf where allowed, and one `np.minimum` into the logits' own memory
applies it without a branch (a NaN logit stays NaN). When the masks cover the batch's first rows
in order (`rows` None: 100% structured traffic) that is all; otherwise the named rows are
gathered, masked and scattered back. Ids past the bitmask's width are masked too.
"""

from __future__ import annotations

import numpy as np
import torch

# Per float type: the unsigned type of its width, its sign bit and +inf's bit pattern.
_BITS = {np.dtype(np.float32): (np.uint32, 31, 0x7F800000), np.dtype(np.float16): (np.uint16, 15, 0x7C00)}


def apply_grammar_mask_host(
    logits: torch.Tensor,  # [num_seqs, vocab] float in host memory, written in place
    bitmask: torch.Tensor,  # [num_masks, words] int32 in host memory, LSB first, bit 1 = allowed
    rows: torch.Tensor | None,  # [num_masks] int64: the logits row of each mask (distinct); None: 0..num_masks-1
) -> None:
    """The same result as `apply_grammar_mask_ref`."""
    num_masks, words = bitmask.shape
    if num_masks == 0:
        return
    if logits.dtype is torch.bfloat16:    # numpy has no bfloat16: the torch reference
        from kernels.grammar_mask_ref import apply_grammar_mask_ref
        apply_grammar_mask_ref(logits, bitmask, torch.arange(num_masks) if rows is None else rows)
        return
    values = logits.numpy()
    unsigned, sign, inf = _BITS[values.dtype]
    width = min(values.shape[1], words * 32)
    forbidden = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, count=width,
                              bitorder="little")                              # [num_masks, width] 0/1
    bound = forbidden.astype(unsigned)
    bound <<= sign
    bound |= unsigned(inf)                                                    # -inf / +inf
    ids = None if rows is None else rows.numpy()
    masked = values[:num_masks] if ids is None else values[ids]      # a view, or the gathered rows
    np.minimum(masked[:, :width], bound.view(values.dtype), out=masked[:, :width])
    if width < values.shape[1]:
        masked[:, width:] = -np.inf
    if ids is not None:
        values[ids] = masked
