"""A step's grammar masks on their way to the device, and what the sampler does with them.

The backend fills one host row per constrained request (only those: free rows are not sent), in
reused memory that is pinned on CUDA; one non-blocking copy takes the rows up behind the forward
pass already queued, with the sampler row each belongs to. The sampler applies them before
anything else (`kernels.apply_grammar_mask`), so penalties, temperature, top-k/p and the
returned logprobs all see the constrained distribution (vLLM's order). A CUDA graph's logits are
masked after the graph, eagerly: the mask never enters a graph.

A CPU engine also keeps each row unpacked into -inf/+inf bounds (`bounds`, filled beside the
forward pass with the bits, `engine.grammar.fill_ahead`), so the sampling step masks with one
`torch.minimum` that also makes the sampler's copy (`kernels.grammar_mask_host`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.sampling.random_sampling import to_device
from kernels.grammar_mask_host import apply_grammar_bounds

# A CPU engine's unpacked bounds are 32x the bitmask: kept only up to this many floats (64 MB).
MAX_BOUND_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class GrammarMask:
    """The masks of one sampling step. `rows[j]` (a sampler row) takes `bitmask[j]`; `rows` None
    (host memory only): sampler row `j` takes `bitmask[j]`, masked in place. `end_only_rows` are
    sampler rows whose grammar allows nothing but an end token, where `min_tokens` must not ban it
    (the grammar wins: a row is never fully masked)."""

    bitmask: torch.Tensor          # [num_masks, words] int32 on the logits' device
    rows: torch.Tensor | None      # [num_masks] int64, or None: 0..num_masks-1
    end_only_rows: frozenset[int] = frozenset()
    bounds: torch.Tensor | None = None   # [num_masks, vocab] fp32 host: the bitmask unpacked (-inf/+inf)

    def apply(self, logits: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """Mask `logits` ([num_seqs, vocab] float) in place, or a copy of it (`copy`: `logits` is
        left as it is); returns the masked logits."""
        bounds = self.bounds
        if bounds is not None and logits.dtype is bounds.dtype and logits.shape[1] == bounds.shape[1] \
                and logits.device.type == "cpu":
            return apply_grammar_bounds(logits, bounds, self.rows, copy)
        if copy:
            logits = logits.clone()
        kernels.apply_grammar_mask(logits, self.bitmask, self.rows)
        return logits


class BitmaskBuffers:
    """Host rows for the backend to fill and their device twin, reused every step (grown on need);
    on a CPU their bounds beside them (`bounds_rows`), cut to `vocab_width` for the sampler."""

    def __init__(self, words: int, device: torch.device, rows: int = 16, vocab_width: int | None = None) -> None:
        self.words = words
        self.device = device
        self.vocab_width = words * 32 if vocab_width is None else vocab_width
        self._copied: torch.cuda.Event | None = None
        self._allocate(rows)

    def _allocate(self, rows: int) -> None:
        cuda = self.device.type == "cuda"
        old = getattr(self, "_host", None)
        self._host = torch.zeros(rows, self.words, dtype=torch.int32, pin_memory=cuda)
        if old is not None:     # rows filled ahead (`StructuredOutputs.advance`) stay
            self._host[:old.shape[0]] = old
        self._host_array = self._host.numpy()
        old_bounds = getattr(self, "_bounds", None)
        self._bounds = (torch.empty(rows, self.words * 32, dtype=torch.float32)
                        if not cuda and rows * self.words * 32 <= MAX_BOUND_ELEMENTS else None)
        if old_bounds is not None and self._bounds is not None:
            self._bounds[:old_bounds.shape[0]] = old_bounds
        self._bounds_array = None if self._bounds is None else self._bounds.numpy()
        self._device = torch.empty(rows, self.words, dtype=torch.int32, device=self.device) if cuda else None
        # Sampler rows 0..n-1 (every row constrained, 100% structured traffic): no new index tensor
        # (on the host none at all: the mask is applied to the logits' first rows in place).
        self._first_rows = torch.arange(rows, device=self.device) if cuda else None

    def host_rows(self, num_rows: int) -> np.ndarray:
        """`int32[num_rows, words]` for the backend to fill, once the last upload has left it."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if num_rows > self._host.shape[0]:
            self._allocate(1 << (num_rows - 1).bit_length())
        return self._host_array[:num_rows]

    def bounds_rows(self, num_rows: int) -> np.ndarray | None:
        """`float32[num_rows, 32 * words]` beside `host_rows(num_rows)` (call that first), for
        `kernels.grammar_mask_bounds`; None on CUDA or past `MAX_BOUND_ELEMENTS`."""
        return None if self._bounds_array is None else self._bounds_array[:num_rows]

    def upload(self, num_rows: int, sampler_rows: list[int], end_only_rows: frozenset[int]) -> GrammarMask:
        """The filled rows as a `GrammarMask` on the device (queued, not waited for); on a CPU with
        their bounds, which the caller has filled. `sampler_rows`: increasing, so the last one is
        `num_rows - 1` only when they are 0..n-1."""
        first_rows = sampler_rows[-1] == num_rows - 1
        if self._device is None:
            rows = None if first_rows else torch.tensor(sampler_rows, dtype=torch.int64)
            bounds = None if self._bounds is None else self._bounds[:num_rows, :self.vocab_width]
            return GrammarMask(self._host[:num_rows], rows, end_only_rows, bounds)
        if first_rows:
            rows = self._first_rows[:num_rows]
        else:
            rows = to_device(torch.tensor(sampler_rows, dtype=torch.int64), self.device)
        bitmask = self._device[:num_rows]
        bitmask.copy_(self._host[:num_rows], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return GrammarMask(bitmask, rows, end_only_rows)
