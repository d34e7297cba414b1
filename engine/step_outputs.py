"""`StepOutputs`: one engine step's outputs as columns, not one `RequestOutput` per request.

Why: a decode step of 256 requests built 256 `RequestOutput`s (14 fields each), the largest
per-request cost of the host step (`bench/host_step.py`). Almost every row of a steady decode step
says only "request r gained token t": it is a *token row*, two list slots (the request, its
token). Every other row (the request finished, asked for logprobs, has a detokenizer, or carries
its prompt logprobs) keeps its full `RequestOutput`, built by the engine as before (a speculative
step, whose rows gain several tokens, returns a plain list).

Readers that want the columns (the decode pod's writer packs token rows into three repeated
fields) call `split`; every other reader iterates, and gets `RequestOutput`s in batch order, each
token row built on read, exactly as the engine would have built it (`token_row_output`;
`tests/engine/test_async_scheduling.py` checks the round trip). A token row's fields are those of its
request that no longer change once it decodes, plus its token, so reading them later (the pod's
writer thread) is safe; `output_token_ids` is the request's live list, as it always was.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from itertools import compress, count
from operator import attrgetter
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.request import RequestStatus

if TYPE_CHECKING:
    from engine.request import Request

_STATUS, _REQUEST_ID = attrgetter("status"), attrgetter("request_id")
_RUNNING = RequestStatus.RUNNING


def token_row_output(request: Request, token_id: int) -> RequestOutput:
    """The `RequestOutput` of a token row: `request` gained `token_id` and nothing else happened
    (running, so no stop reason; no logprobs, no text, no prompt logprobs)."""
    return RequestOutput(request.request_id, [token_id], [None], "", False, None, len(request.prompt_token_ids),
                         request.num_cached_tokens, request.output_token_ids, "", request.first_token_time,
                         request.arrival_time, request.first_scheduled_time, None)


def other_rows(requests: list[Request], logprobs: list, detokenizing: Container[str], every_row: bool
               ) -> list[int] | None:
    """The rows of a step that need their own `RequestOutput` (None: every row is a token row):
    not running (finished: a reason, a flush, state to drop), logprobs, or a detokenizer in
    `detokenizing` (text, stop strings); `every_row`: all of them (prompt logprobs to hand out).
    C-level screens first: the usual decode step has no such row."""
    n = len(requests)
    if every_row:
        return list(range(n))
    statuses = list(map(_STATUS, requests))
    texts = list(map(detokenizing.__contains__, map(_REQUEST_ID, requests))) if detokenizing else None
    if logprobs.count(None) == n and statuses.count(_RUNNING) == n and not (texts and any(texts)):
        return None
    return [i for i, (status, lp) in enumerate(zip(statuses, logprobs))
            if status is not _RUNNING or lp is not None or (texts is not None and texts[i])]


class StepOutputs(Sequence[RequestOutput]):
    """One step's outputs, in batch order: `requests[i]` gained `token_ids[i]`; `others` maps the
    rows that are not token rows to their `RequestOutput` (built by the engine, side effects
    done). A sequence of `RequestOutput`s to readers that iterate (token rows built on each read:
    treat them as read-only), columns to readers that `split`."""

    __slots__ = ("requests", "token_ids", "others")

    def __init__(self, requests: list[Request], token_ids: list[int],
                 others: dict[int, RequestOutput] | None = None) -> None:
        self.requests = requests
        self.token_ids = token_ids
        self.others = others or {}

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self.requests)
        out = self.others.get(i)
        return out if out is not None else token_row_output(self.requests[i], self.token_ids[i])

    def __iter__(self) -> Iterator[RequestOutput]:
        others = self.others
        for i, (request, token_id) in enumerate(zip(self.requests, self.token_ids)):
            out = others.get(i) if others else None
            yield out if out is not None else token_row_output(request, token_id)

    def __repr__(self) -> str:
        return f"StepOutputs({len(self.requests)} rows, {len(self.others)} with their own output)"


def split(outputs: Sequence[RequestOutput], own: Callable[[str], bool] | None = None
          ) -> tuple[list[str], list[int], list[RequestOutput]]:
    """(token rows' request ids, their tokens, every other row's `RequestOutput`, in batch order)
    of a step's outputs: a `StepOutputs`, or a plain list (all of it "other"). `own(request_id)`
    true: that token row goes with the others, as a `RequestOutput` (built here)."""
    if not isinstance(outputs, StepOutputs):
        return [], [], list(outputs)
    requests, tokens, others = outputs.requests, outputs.token_ids, outputs.others
    ids = list(map(_REQUEST_ID, requests))
    if own is not None:
        marks = list(map(own, ids))
        if any(marks):   # a row that has its own output keeps it (it may be the request's last)
            others = {**{i: token_row_output(requests[i], tokens[i]) for i in compress(count(), marks)}, **others}
    if not others:
        return ids, list(tokens), []
    rows = [i for i in range(len(ids)) if i not in others]
    return [ids[i] for i in rows], [tokens[i] for i in rows], [others[i] for i in sorted(others)]
