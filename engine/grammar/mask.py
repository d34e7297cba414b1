"""A step's grammar masks on their way to the device, and what the sampler does with them.

The backend fills one host row per constrained request (only those: free rows are not sent), in
reused memory that is pinned on CUDA; one non-blocking copy takes the rows up behind the forward
pass already queued, with the sampler row each belongs to. The sampler applies them before
anything else (`kernels.apply_grammar_mask`), so penalties, temperature, top-k/p and the
returned logprobs all see the constrained distribution (vLLM's order). A CUDA graph's logits are
masked after the graph, eagerly: the mask never enters a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.sampling.random_sampling import to_device


@dataclass(frozen=True)
class GrammarMask:
    """The masks of one sampling step. `rows[j]` (a sampler row) takes `bitmask[j]`; `rows` None
    (host memory only): sampler row `j` takes `bitmask[j]`, masked in place. `end_only_rows` are
    sampler rows whose grammar allows nothing but an end token, where `min_tokens` must not ban it
    (the grammar wins: a row is never fully masked)."""

    bitmask: torch.Tensor          # [num_masks, words] int32 on the logits' device
    rows: torch.Tensor | None      # [num_masks] int64, or None: 0..num_masks-1
    end_only_rows: frozenset[int] = frozenset()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask `logits` ([num_seqs, vocab] float) in place; returns it."""
        kernels.apply_grammar_mask(logits, self.bitmask, self.rows)
        return logits


class BitmaskBuffers:
    """Host rows for the backend to fill and their device twin, reused every step (grown on need)."""

    def __init__(self, words: int, device: torch.device, rows: int = 16) -> None:
        self.words = words
        self.device = device
        self._copied: torch.cuda.Event | None = None
        self._allocate(rows)

    def _allocate(self, rows: int) -> None:
        cuda = self.device.type == "cuda"
        old = getattr(self, "_host", None)
        self._host = torch.zeros(rows, self.words, dtype=torch.int32, pin_memory=cuda)
        if old is not None:     # rows filled ahead (`StructuredOutputs.advance`) stay
            self._host[:old.shape[0]] = old
        self._host_array = self._host.numpy()
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

    def upload(self, num_rows: int, sampler_rows: list[int], end_only_rows: frozenset[int]) -> GrammarMask:
        """The filled rows as a `GrammarMask` on the device (queued, not waited for).
        `sampler_rows`: increasing, so the last one is `num_rows - 1` only when they are 0..n-1."""
        first_rows = sampler_rows[-1] == num_rows - 1
        if self._device is None:
            rows = None if first_rows else torch.tensor(sampler_rows, dtype=torch.int64)
            return GrammarMask(self._host[:num_rows], rows, end_only_rows)
        if first_rows:
            rows = self._first_rows[:num_rows]
        else:
            rows = to_device(torch.tensor(sampler_rows, dtype=torch.int64), self.device)
        bitmask = self._device[:num_rows]
        bitmask.copy_(self._host[:num_rows], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return GrammarMask(bitmask, rows, end_only_rows)
