"""The scheduler's per-step plan: a plain value (no tensors, no I/O) the runner executes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

# With async scheduling, a request's newest token is still on the device when the next step is
# planned: its place in `Request.token_ids` holds this id until the engine resolves the sample.
PLACEHOLDER_TOKEN_ID = -1

new_scheduled_seq = tuple.__new__   # builds a ScheduledSeq without NamedTuple's Python-level __new__


class ScheduledSeq(NamedTuple):
    """One request's share of a step. A NamedTuple (immutable, ~5x cheaper to build than a frozen
    dataclass) because one is built per running request per step; the hot path builds it with
    `new_scheduled_seq(ScheduledSeq, (...))`, skipping even NamedTuple's `__new__`."""

    request_id: str
    token_ids: tuple[int, ...]      # the tokens whose KV this step computes
    start_position: int             # = num_computed_tokens before this step
    block_ids: tuple[int, ...]      # the request's whole block table
    sample: bool | int              # all tokens computed after this step: sample a new one; an int
                                    # 1 + k: a decode with k drafts (engine.spec_decode) samples its
                                    # last 1 + k tokens (True is 1: one row)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


class DecodeSeqs(Sequence[ScheduledSeq]):
    """A steady decode step's `SchedulerOutput.scheduled` (`engine.decode_columns`): read as
    `ScheduledSeq`s (built once, on the first read), or by its columns (`ids`, `token_ids`,
    `starts`, `tables`, `width`) where a reader knows them (`StepInputs.prepare`,
    `DecodeBuckets.bucket`, `sampled_requests`, the step stats). Every seq is a decode of one
    token that samples."""

    __slots__ = ("ids", "token_ids", "starts", "tables", "width", "all_placeholders", "_seqs")

    def __init__(self, ids: list[str], token_ids: list[int], starts: np.ndarray, tables: list[tuple[int, ...]],
                 width: int, all_placeholders: bool) -> None:
        self.ids = ids                  # request ids, batch order (read-only: shared with the columns)
        self.token_ids = token_ids      # each seq's one token
        self.starts = starts            # [S] int64: each seq's start position (= num_computed_tokens)
        self.tables = tables            # each seq's block table (the KV manager's tuples)
        self.width = width              # the longest table's length
        self.all_placeholders = all_placeholders   # every token is PLACEHOLDER_TOKEN_ID (on the device)
        self._seqs: tuple[ScheduledSeq, ...] | None = None

    def seqs(self) -> tuple[ScheduledSeq, ...]:
        if self._seqs is None:
            new, seq_type = new_scheduled_seq, ScheduledSeq
            self._seqs = tuple(new(seq_type, (request_id, (token,), start, table, True)) for request_id, token, start,
                               table in zip(self.ids, self.token_ids, self.starts.tolist(), self.tables))
        return self._seqs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.seqs()[i]

    def __iter__(self):
        return iter(self.seqs())

    def __eq__(self, other) -> bool:
        return self.seqs() == (other.seqs() if isinstance(other, DecodeSeqs) else other)

    def __hash__(self) -> int:
        return hash(self.seqs())

    def __repr__(self) -> str:
        return f"DecodeSeqs({len(self.ids)} decodes)"


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes; a plain value (no tensors). `scheduled` is in batch order."""

    scheduled: tuple[ScheduledSeq, ...] | DecodeSeqs    # DecodeSeqs: a steady decode step as columns
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    reserved_request_ids: tuple[str, ...] = ()   # decode role: blocks reserved, start the KV pull
    finished_request_ids: tuple[str, ...] = ()   # finished/aborted since the last step: drop state

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


_SAMPLES, _REQUEST_ID = itemgetter(4), itemgetter(0)


def sampled_requests(seqs: tuple[ScheduledSeq, ...] | DecodeSeqs, requests: list) -> tuple[list, list[str]]:
    """(the requests that sample this step, their ids), in batch order; `requests[i]` owns
    `seqs[i]` (returned as is when every seq samples: read it, do not change it). The usual step
    samples every seq, and then this is two C-level passes, not a Python loop over the batch."""
    if isinstance(seqs, DecodeSeqs):
        return requests, seqs.ids
    if all(map(_SAMPLES, seqs)):
        return requests, list(map(_REQUEST_ID, seqs))
    rows = [i for i, seq in enumerate(seqs) if seq[4]]
    return [requests[i] for i in rows], [seqs[i][0] for i in rows]
