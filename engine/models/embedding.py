"""The vocab-parallel embedding of a tensor-parallel model (one all-reduce per lookup)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Rank's rows `[start, start + rows)` of the embedding; a token outside them looks up zeros,
    and one all-reduce sums the ranks' rows into the full lookup."""

    def __init__(self, start: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 comm) -> None:
        super().__init__()
        self.start, self.rows, self.comm = start, rows, comm
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start                              # [T]
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))
