"""`HiddenStates`: the target's recent final hidden states, kept on the device for an EAGLE head.

Every target forward writes its `[T, hidden]` states into one ring of rows (one copy a step,
whatever the batch), and each request remembers, as host-side ints, which ring rows hold which of
its positions (`Chunks`). The head reads them when it next proposes (`gather`): after plain steps
too, so the adaptive controller can leave speculation off for a while without running the head.
A position whose row was overwritten since (the ring is full), or that no forward of this engine
computed (prefix-cache hits, a prompt prefilled on another pod), reads the zero row: the head then
has only the token there, which costs acceptance, never exactness (verification decides).
"""

from __future__ import annotations

import numpy as np
import torch


class Chunks:
    """One request's positions in the ring: `(position, absolute ring row, count)` runs, in order."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []

    def record(self, position: int, row: int, count: int, oldest: int, needed: int) -> None:
        """Positions `[position, position + count)` are at rows `row...`; what the request had at
        those positions or later (rejected drafts' rows), rows older than `oldest` and positions
        before `needed` (the head has read them) are dropped."""
        runs = self.runs
        while runs and runs[-1][0] >= position:
            runs.pop()
        if runs and runs[-1][0] + runs[-1][2] > position:
            start, first, _ = runs[-1]
            runs[-1] = (start, first, position - start)
        while runs and (runs[0][1] + runs[0][2] <= oldest or runs[0][0] + runs[0][2] <= needed):
            runs.pop(0)
        runs.append((position, row, count))


class HiddenStates:
    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_rows = num_rows
        self.ring = torch.zeros(num_rows + 1, hidden_size, dtype=dtype, device=device)   # row num_rows: zeros
        self.written = 0          # rows written so far; absolute row r lives at r % num_rows
        self.device = device

    @property
    def oldest(self) -> int:
        """The oldest absolute row still in the ring."""
        return max(0, self.written - self.num_rows)

    def write(self, hidden: torch.Tensor) -> int:
        """Append a forward's `[T, hidden]` states; returns the absolute row of the first (rows
        past the ring's size fall out at once: `oldest`)."""
        first, n = self.written, hidden.shape[0]
        self.written = first + n
        kept = min(n, self.num_rows)
        hidden, at = hidden[n - kept:], (first + n - kept) % self.num_rows
        head = min(kept, self.num_rows - at)
        self.ring[at:at + head].copy_(hidden[:head], non_blocking=True)
        if head < kept:
            self.ring[:kept - head].copy_(hidden[head:], non_blocking=True)
        return first

    def gather(self, spans: list[tuple[Chunks, int, int]]) -> torch.Tensor:
        """`[sum(count), hidden]`: the states of each `(chunks, start, count)` span's positions in
        order (zeros where the ring has none)."""
        total = sum(count for _, _, count in spans)
        index = np.full(total, self.num_rows, np.int64)
        oldest, at = self.oldest, 0
        for chunks, start, count in spans:
            stop = start + count
            for position, row, n in chunks.runs:
                lo, hi = max(start, position), min(stop, position + n)
                if lo < hi:
                    rows = np.arange(row + lo - position, row + hi - position)
                    index[at + lo - start:at + hi - start] = np.where(rows >= oldest, rows % self.num_rows,
                                                                      self.num_rows)
            at += count
        return self.ring.index_select(0, torch.from_numpy(index).to(self.device, non_blocking=True))
