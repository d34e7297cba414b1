"""`HiddenStates`: the target's recent final hidden states, kept on the device for an EAGLE head.

Every target forward writes its `[T, hidden]` states into one ring of rows (one copy a step,
whatever the batch), and each request remembers, as host-side ints, which ring rows hold which of
its positions (`Chunks`). The head reads them when it next proposes (`gather`): after plain steps
too, so the adaptive controller can leave speculation off for a while without running the head.

A forward's own output tensor (an eager step's: no later step writes it) is not copied when it
comes (`write(..., owned=True)`): it is kept by reference and copied into the ring when the head
next reads (`flush`, before `gather`), or dropped once newer rows have pushed all of it out of the
ring. So a step that does not speculate pays a list append, not a device copy: on `tiny` on a
CPU the copy was ~30 us of a ~5 ms step at batch 1. A graphed step's states live in a buffer the
next replay overwrites: copied at once, as before (after the held ones, which are older).
A position whose row was overwritten since (the ring is full), or that no forward of this engine
computed (prefix-cache hits, a prompt prefilled on another pod), reads the zero row: the head then
has only the token there, which costs acceptance, never exactness (verification decides).
"""

from __future__ import annotations

from collections import deque

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
        self._held: deque[tuple[int, torch.Tensor]] = deque()   # (first absolute row, states) not copied yet

    @property
    def oldest(self) -> int:
        """The oldest absolute row still in the ring."""
        return max(0, self.written - self.num_rows)

    def write(self, hidden: torch.Tensor, owned: bool = False) -> int:
        """Append a forward's `[T, hidden]` states; returns the absolute row of the first (rows
        past the ring's size fall out at once: `oldest`). `owned`: nothing writes `hidden` later,
        so it is held until the head reads (module docstring); else it is copied now."""
        first, n = self.written, hidden.shape[0]
        self.written = first + n
        held, oldest = self._held, self.oldest
        if owned:
            held.append((first, hidden))
            while held[0][0] + held[0][1].shape[0] <= oldest:   # all of it pushed out by newer rows
                held.popleft()
        else:
            if held:
                self.flush()
            self._copy(first, hidden)
        return first

    def flush(self) -> None:
        """Copy the held states into the ring (what is still in it)."""
        held, oldest = self._held, self.oldest
        while held:
            first, hidden = held.popleft()
            if first < oldest:
                hidden, first = hidden[oldest - first:], oldest
            if hidden.shape[0]:
                self._copy(first, hidden)

    def _copy(self, first: int, hidden: torch.Tensor) -> None:
        """Rows `first...` into the ring (the last `num_rows` of them: the rest fall out)."""
        n = hidden.shape[0]
        kept = min(n, self.num_rows)
        hidden, at = hidden[n - kept:], (first + n - kept) % self.num_rows
        head = min(kept, self.num_rows - at)
        self.ring[at:at + head].copy_(hidden[:head], non_blocking=True)
        if head < kept:
            self.ring[:kept - head].copy_(hidden[head:], non_blocking=True)

    def gather(self, spans: list[tuple[Chunks, int, int]]) -> torch.Tensor:
        """`[sum(count), hidden]`: the states of each `(chunks, start, count)` span's positions in
        order (zeros where the ring has none)."""
        if self._held:
            self.flush()
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
