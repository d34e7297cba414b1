"""One request's prompt logprobs on the host, in the flat layout the wire message uses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    """Scores of prompt tokens 1..n-1 (token 0 has no context to be scored on): entry `i` is
    prompt token `i + 1`, with its logprob, its rank in the vocabulary (1 = most likely) and the
    `num_top` most likely tokens at that position (`top_*[i * num_top:(i + 1) * num_top]`)."""

    num_top: int
    token_logprobs: list[float] = field(default_factory=list)
    token_ranks: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @property
    def num_scored(self) -> int:
        return len(self.token_logprobs)

    def to_proto(self, msg) -> None:
        """Fill a `cbserve_pb2.PromptLogprobs` message (packed fields: one extend each). The message
        is marked present even when empty (a one-token prompt has no scored token)."""
        msg.SetInParent()
        msg.num_top = self.num_top
        msg.token_logprobs.extend(self.token_logprobs)
        msg.token_ranks.extend(self.token_ranks)
        msg.top_token_ids.extend(self.top_token_ids)
        msg.top_logprobs.extend(self.top_logprobs)

    @classmethod
    def from_proto(cls, msg) -> PromptLogprobs:
        return cls(msg.num_top, list(msg.token_logprobs), list(msg.token_ranks), list(msg.top_token_ids),
                   list(msg.top_logprobs))
