"""`StepShape`: what an engine step computes, reduced to what its duration depends on.

A step's cost depends on its decodes through their count, their total context (each attends over
its own context) and their longest and shortest context (the CPU path pads every decode row to the
longest one, and needs a mask, a slower kernel, unless all are equal),
and on each prefill chunk through its length and the context it starts at (the chunk attends over
everything before it and itself). So a shape keeps the decodes summed and the chunks listed: a sufficient statistic for every cost-model feature (`cost_model.py`), small enough
to store by the thousand in a profile, and cheap to take from a `SchedulerOutput` on the
simulator's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduling.output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    num_decodes: int                          # sequences computing one token
    decode_context_tokens: int                # sum over them of the context they attend to (start + 1)
    max_decode_context: int = 0               # the longest of those contexts
    min_decode_context: int = 0               # the shortest
    prefill_chunks: tuple[tuple[int, int], ...] = ()   # (tokens, start position) of each longer sequence
    num_sampled: int = 0                      # sequences whose logits are sampled this step

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        decodes = context = longest = sampled = 0
        shortest = 1 << 62
        chunks = []
        for seq in out.scheduled:
            n = len(seq.token_ids)
            if n == 1:
                decodes += 1
                start = seq.start_position
                context += start + 1
                if start >= longest:
                    longest = start + 1
                if start < shortest:
                    shortest = start + 1
            else:
                chunks.append((n, seq.start_position))
            sampled += seq.sample
        return cls(decodes, context, longest, shortest if decodes else 0, tuple(chunks), sampled)

    def decode_part(self) -> StepShape:
        """The step's decode rows alone (each samples)."""
        return StepShape(self.num_decodes, self.decode_context_tokens, self.max_decode_context,
                         self.min_decode_context, (), min(self.num_sampled, self.num_decodes))

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + len(self.prefill_chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens

    def to_json(self) -> list:
        return [self.num_decodes, self.decode_context_tokens, self.max_decode_context, self.min_decode_context,
                [list(c) for c in self.prefill_chunks], self.num_sampled]

    @classmethod
    def from_json(cls, value: list) -> StepShape:
        decodes, context, longest, shortest, chunks, sampled = value
        return cls(int(decodes), int(context), int(longest), int(shortest),
                   tuple((int(n), int(s)) for n, s in chunks), int(sampled))
