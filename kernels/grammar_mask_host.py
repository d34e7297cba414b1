"""`kernels.apply_grammar_mask` on host memory (the CPU path): numpy on the tensors' memory.

The torch reference (`grammar_mask_ref`) spells the bit order out in ~10 tensor ops, and a
masked fill branches on every token (a mispredicted branch wherever allowed and forbidden tokens
alternate); on a CPU engine this runs on the sampling step's critical path, once per step. Here
each byte of the packed rows is looked up in a 256 x 8 table of -inf (forbidden) / +inf
(allowed) bounds (`grammar_mask_bounds`, one `np.take`), and one `np.minimum` into the logits'
own memory applies them without a branch (a NaN logit stays NaN). When the masks cover the
batch's first rows in order (`rows` None: 100% structured traffic) that is all; otherwise the
named rows are gathered, masked and scattered back. Ids past the bitmask's width are masked too.

A CPU engine makes the bounds beside the forward pass, into reused memory
(`engine.grammar.fill_ahead`); what is left for the sampling step is `apply_grammar_bounds`:
one `torch.minimum`. Each numpy or torch call costs ~10-25 µs there, cache-cold after the
forward, so the five calls the unpacking took cost ~100 µs and one costs ~20.
"""

from __future__ import annotations

import numpy as np
import torch

# Per float type: the 8 bounds of each byte value of a packed bitmask (bit k of byte b, LSB first:
# +inf where allowed, -inf where forbidden).
_BYTE_BOUNDS = {dtype: np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                                np.inf, -np.inf).astype(dtype) for dtype in (np.float32, np.float16)}


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
    width = min(values.shape[1], words * 32)
    bound = np.empty((num_masks, words * 32), dtype=values.dtype)
    grammar_mask_bounds(bitmask.numpy(), bound)
    ids = None if rows is None else rows.numpy()
    masked = values[:num_masks] if ids is None else values[ids]      # a view, or the gathered rows
    np.minimum(masked[:, :width], bound[:, :width], out=masked[:, :width])
    if width < values.shape[1]:
        masked[:, width:] = -np.inf
    if ids is not None:
        values[ids] = masked


def grammar_mask_bounds(
    bitmask: np.ndarray,  # [num_masks, words] int32, LSB first, bit 1 = allowed
    out: np.ndarray,  # [num_masks, words * 32] float32 or float16, C-contiguous: written
) -> None:
    """Each row's bits as bounds: +inf where allowed, -inf where forbidden, so that
    `minimum(logits, out[:, :vocab])` is `apply_grammar_mask_ref` on those rows. One table
    lookup per byte of the bitmask: a single numpy call."""
    num_masks, words = bitmask.shape
    bytes_out = out.view()
    bytes_out.shape = (num_masks, words * 4, 8)      # a view of `out` (raises rather than copy)
    np.take(_BYTE_BOUNDS[out.dtype.type], bitmask.view(np.uint8), axis=0, mode="clip", out=bytes_out)


def apply_grammar_bounds(
    logits: torch.Tensor,  # [num_seqs, vocab] float in host memory
    bounds: torch.Tensor,  # [num_masks, vocab] the same dtype: `grammar_mask_bounds` of each mask (cut to vocab)
    rows: torch.Tensor | None,  # [num_masks] int64: the logits row of each mask (distinct); None: 0..num_masks-1
    copy: bool,  # True: leave `logits` as it is and return a masked copy
) -> torch.Tensor:
    """`logits` masked by the bounds (in place unless `copy`); returns the masked logits. When
    every row has a mask in order, the copy is the minimum itself: no separate clone."""
    num_masks = bounds.shape[0]
    if copy and rows is None and num_masks == logits.shape[0]:
        return torch.minimum(logits, bounds)
    if copy:
        logits = logits.clone()
    if rows is None:
        head = logits[:num_masks]
        torch.minimum(head, bounds, out=head)
    elif num_masks:
        logits[rows] = torch.minimum(logits[rows], bounds)
    return logits
