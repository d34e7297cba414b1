"""The lm_head over a step's sampled rows and its prompt-logprob rows, a bounded slice at a time.

A prompt chunk can ask for thousands of logits rows (`max_num_batched_tokens`), and
`[rows, vocab]` fp32 for all of them at once would dwarf the memory the KV cache was sized around
(the profiling step computes logits for `max_num_seqs` rows). So the rows go through the head in
slices of `slice_rows` (= `max_num_seqs`): the first slice holds the sampled rows, which the
sampler reads after the step, and every extra row goes to `StepRows.consume` as its slice is done.

Tensor parallel: `compute_logits` is a collective, and ranks other than 0 do not know how many
of the rows are extra. The slicing depends on the total row count alone (in the step's layout,
which every rank has), so every rank makes the same calls; those ranks pass `extra=None` and
drop what they compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def sliced_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  slice_rows: int, extra=None, keep_all: bool = False) -> torch.Tensor:
    """hidden: [num_sampled + num_extra, hidden], sampled rows first -> the sampled rows' logits
    [num_sampled, vocab]; the extra rows' logits go to `extra.consume(first_extra_row, logits)`.
    Without `extra` it makes the same calls and returns the first slice (tensor-parallel ranks > 0,
    which drop it), or with `keep_all` every row's logits (rank 0 verifying more draft rows than a
    slice holds, speculative decoding)."""
    if extra is None and keep_all:
        return torch.cat([compute_logits(hidden[start:start + slice_rows])
                          for start in range(0, hidden.shape[0], slice_rows)])
    num_rows = hidden.shape[0]
    num_sampled = num_rows - (0 if extra is None else len(extra.rows))
    assert extra is None or 0 <= num_sampled <= slice_rows, "the sampled rows must fit the first slice"
    first = compute_logits(hidden[:slice_rows])                          # [min(rows, slice), vocab]
    if extra is not None and first.shape[0] > num_sampled:
        extra.consume(0, first[num_sampled:])
    for start in range(slice_rows, num_rows, slice_rows):
        logits = compute_logits(hidden[start:start + slice_rows])
        if extra is not None:
            extra.consume(start - num_sampled, logits)
    return first[:num_sampled]
