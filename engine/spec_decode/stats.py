"""Speculative decoding's counts: cumulative per engine, plain Python (no torch, no Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counts since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)       # [k]
    acceptance_lengths: list[int] = field(default_factory=list)     # [k + 1]: verifications emitting 1..k+1

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` drafts that accepted `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos, lengths = self.accepted_per_pos, self.acceptance_lengths
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
            lengths.extend([0] * (num_drafts + 1 - len(lengths)))
        for i in range(num_accepted):
            per_pos[i] += 1
        lengths[num_accepted] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos), list(self.acceptance_lengths))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification (accepted + 1); 0 before the first."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0
