"""The steady decode batch as columns: a step of it costs numpy, not a Python pass per request.

Why: with async scheduling a GPU step runs while the host plans the next one, so the host step
must stay below the GPU's (~1.5-2 ms at batch 256 on an H200). Planned one request at a time, a
steady decode batch of 256 cost ~3-4 µs of Python per request per step (`bench/host_step.py`):
a `ScheduledSeq` built in `schedule`, unpacked again in `StepInputs.prepare`, then the advance
and placeholder in `update`. A steady decode step changes every request in the same way (one
more computed token, one more placeholder), so here it is planned as columns: `starts + 1`, the
rows that need a new block, and the rows that reach their length.

When (`Scheduler.schedule`): the engine asked for columns (`Scheduler.decode_columns`: async
scheduling), at least `COLUMNS_MIN_BATCH` requests run, no drafts, no LoRA, every running
request decodes one token, nothing is admitted,
and the pool has a token and a block for every running request (nothing can preempt). Any other
step takes the general path, unchanged.

One owner per fact: the `Request`s. The columns hold (a) what never changes about a request
while it runs (its id, its token lists' objects, prompt + max_tokens, what its params ask),
gathered once when it joins the columns, and (b) the plan of the step (`starts`, `tables`),
which `update_columns` writes into the requests (`num_computed_tokens`, the placeholders) and
the next `schedule` advances by one. (b) is trusted only from a columns update to the next
schedule (`ready`); any general step, or a request joining, clears it, and the next columns step
reads (b) again from the requests (C-level passes). Membership follows `Scheduler.running`: rows
of requests that left are dropped, requests that joined at its end are appended, and any other
change (a reorder) gathers every row afresh.

Readers of `SchedulerOutput.scheduled` that do not know columns see `ScheduledSeq`s exactly as
the general path would have built them (`DecodeSeqs`, built on first read;
`tests/engine/test_decode_columns.py` checks both paths against each other).
"""

from __future__ import annotations

import operator
from itertools import compress, repeat
from typing import TYPE_CHECKING

import numpy as np

from engine.request import Request, RequestStatus
from engine.scheduling.output import PLACEHOLDER_TOKEN_ID, DecodeSeqs, SchedulerOutput

if TYPE_CHECKING:
    from engine.scheduling.state import SchedulerState   # the Scheduler's state (importing the Scheduler would be a circle)

_RUNNING, _ABORTED = RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED
_TOKENS, _OUTPUTS, _COMPUTED, _ID, _PROMPT, _PARAMS, _FIRST_TOKEN, _STATUS = (operator.attrgetter(name) for name in (
    "token_ids", "output_token_ids", "num_computed_tokens", "request_id", "prompt_token_ids", "sampling_params",
    "first_token_time", "status"))
_MAX_TOKENS, _STOP_IDS, _HOST_TOKENS = (operator.attrgetter(name) for name in (
    "max_tokens", "stop_token_ids", "reads_host_tokens"))
_LAST = operator.itemgetter(-1)
# Below this many running requests the general path costs less: a numpy call on a few rows costs
# more (~1 µs) than the Python it replaces.
COLUMNS_MIN_BATCH = 16


class DecodeColumns:
    """The columns of a steady decode batch (module docstring): `requests` in batch order."""

    __slots__ = ("requests", "ids", "outputs", "tokens", "limits", "host_rows", "stop_rows", "stop_ids",
                 "started", "starts", "tables", "num_blocks", "ready")

    def __init__(self, requests: list[Request], ids: list[str], outputs: list[list[int]], tokens: list[list[int]],
                 limits: np.ndarray, host_rows: np.ndarray, stop_rows: list, eos_token_ids: frozenset[int],
                 started: bool) -> None:
        self.requests = requests        # a list of its own: never changed in place
        self.ids = ids
        self.outputs = outputs          # the requests' own lists (never replaced)
        self.tokens = tokens
        self.limits = limits            # [S] int64: a length stop once len(token_ids) reaches it
        self.host_rows = host_rows      # [S] bool: its next step reads its newest token on the host
        self.stop_rows = stop_rows      # each row's stop_token_ids
        # The tokens that can end some row when resolved: eos and every row's stop tokens.
        self.stop_ids = eos_token_ids.union(*stop_rows)
        self.started = started          # every row has its first token (time)
        self.starts: np.ndarray | None = None              # [S] int64: this step's start positions
        self.tables: list[tuple[int, ...]] | None = None   # this step's block tables
        self.num_blocks: np.ndarray | None = None          # [S] int64: their lengths
        self.ready = False              # starts/tables are what the last columns update left

    @classmethod
    def of(cls, requests: list[Request], max_model_len: int, eos_token_ids: frozenset[int]) -> DecodeColumns:
        """The columns of `requests` (what never changes about them; no plan yet)."""
        n = len(requests)
        params = list(map(_PARAMS, requests))
        # `_check_stop`'s two length tests in one: len(token_ids) reaches prompt + max_tokens or the model's.
        limits = np.fromiter(map(len, map(_PROMPT, requests)), np.int64, n)
        limits += np.fromiter(map(_MAX_TOKENS, params), np.int64, n)
        return cls(list(requests), list(map(_ID, requests)), list(map(_OUTPUTS, requests)),
                   list(map(_TOKENS, requests)), np.minimum(limits, max_model_len),
                   np.fromiter(map(_HOST_TOKENS, params), np.bool_, n), list(map(_STOP_IDS, params)), eos_token_ids,
                   None not in list(map(_FIRST_TOKEN, requests)))

    def kept(self, keep: list[bool], eos_token_ids: frozenset[int]) -> DecodeColumns:
        """The rows where `keep` (in order), plan and `ready` included."""
        mask = np.array(keep, np.bool_)
        cols = DecodeColumns(*(list(compress(rows, keep)) for rows in (self.requests, self.ids, self.outputs,
                                                                           self.tokens)),
                             self.limits[mask], self.host_rows[mask], list(compress(self.stop_rows, keep)),
                             eos_token_ids, self.started)
        if self.starts is not None:
            cols.starts, cols.tables, cols.num_blocks = (self.starts[mask], list(compress(self.tables, keep)),
                                                         self.num_blocks[mask])
        cols.ready = self.ready
        return cols

    def extended(self, tail: DecodeColumns, eos_token_ids: frozenset[int]) -> DecodeColumns:
        """These rows, then `tail`'s (no plan: the next step reads it)."""
        return DecodeColumns(self.requests + tail.requests, self.ids + tail.ids, self.outputs + tail.outputs,
                             self.tokens + tail.tokens, np.concatenate([self.limits, tail.limits]),
                             np.concatenate([self.host_rows, tail.host_rows]), self.stop_rows + tail.stop_rows,
                             eos_token_ids, self.started and tail.started)

    @property
    def reads_host_tokens(self) -> bool:
        return bool(self.host_rows.any())


def _running_rows(requests: list[Request]) -> list[bool]:
    return list(map(operator.is_, map(_STATUS, requests), repeat(_RUNNING, len(requests))))


def _columns_for(scheduler: SchedulerState, running: list[Request]) -> DecodeColumns:
    """Columns whose rows are `running`: the last ones, with the rows of requests that left
    dropped and those that joined at the end appended; or gathered afresh."""
    cols, max_len, eos = scheduler._columns, scheduler.config.max_model_len, scheduler.eos_token_ids
    if cols is None:
        return DecodeColumns.of(running, max_len, eos)
    if running == cols.requests:
        return cols
    alive = set(running)
    keep = list(map(alive.__contains__, cols.requests))
    num_kept = keep.count(True)
    if running[:num_kept] != list(compress(cols.requests, keep)):     # reordered
        return DecodeColumns.of(running, max_len, eos)
    if num_kept < len(keep):
        cols = cols.kept(keep, eos)
    if num_kept < len(running):
        cols = cols.extended(DecodeColumns.of(running[num_kept:], max_len, eos), eos)
    return cols


def schedule_columns(scheduler: SchedulerState, reserved: tuple, finished: tuple) -> SchedulerOutput | None:
    """This step as columns, or None where the general path must plan it (`Scheduler.schedule`
    checked the budget, the pool, the drafts and the queue). Grows the tables that need a block."""
    running = scheduler.running
    cols = scheduler._columns = _columns_for(scheduler, running)
    kv, n = scheduler.kv_manager, len(running)
    if cols.ready:
        starts = cols.starts + 1        # the placeholder the last update appended is this step's token
        token_ids = [PLACEHOLDER_TOKEN_ID] * n
        all_placeholders = True
        tables, num_blocks = list(cols.tables), cols.num_blocks   # this step's (the output keeps it)
    else:
        starts = np.fromiter(map(_COMPUTED, running), np.int64, n)
        if not (np.fromiter(map(len, cols.tokens), np.int64, n) - starts == 1).all():
            return None                 # a prefill continues: the general path plans this step
        token_ids = list(map(_LAST, cols.tokens))
        all_placeholders = token_ids.count(PLACEHOLDER_TOKEN_ID) == n
        tables = list(map(kv.block_tables.__getitem__, cols.ids))
        num_blocks = np.fromiter(map(len, tables), np.int64, n)
    grow = np.flatnonzero(starts >= num_blocks * scheduler.block_size)
    if len(grow):                       # the pool has a block for each (`_decodes_cannot_run_short`)
        requests = cols.requests
        for i in grow.tolist():
            kv.allocate_slots(requests[i], 1)
            tables[i] = kv.block_table(requests[i])
        num_blocks = num_blocks.copy()
        num_blocks[grow] += 1
    cols.starts, cols.tables, cols.num_blocks, cols.ready = starts, tables, num_blocks, False
    seqs = DecodeSeqs(cols.ids, token_ids, starts, tables, int(num_blocks.max()), all_placeholders)
    out = SchedulerOutput(seqs, n, (), reserved, finished)
    scheduler._pending_output, scheduler._pending_requests = out, cols.requests
    return out


def update_columns(scheduler: SchedulerState, seqs: DecodeSeqs, now: float) -> list[Request] | None:
    """`update(out, None)` of a columns step: every request still running one computed token
    more and a placeholder (the rows of those that left since `schedule` are dropped); None when
    the batch changed otherwise (the general update runs)."""
    cols = scheduler._columns
    if cols is None or seqs.ids is not cols.ids:
        return None
    if scheduler.running != cols.requests:      # finished or aborted since schedule (a stop token)
        keep = _running_rows(cols.requests)
        if list(compress(cols.requests, keep)) != scheduler.running:
            return None
        cols = scheduler._columns = cols.kept(keep, scheduler.eos_token_ids)
    requests, kv, block_size = cols.requests, scheduler.kv_manager, scheduler.block_size
    computed = cols.starts + 1
    placeholder = PLACEHOLDER_TOKEN_ID
    for request, outputs, tokens, num in zip(requests, cols.outputs, cols.tokens, computed.tolist()):
        request.num_computed_tokens = num
        outputs.append(placeholder)
        tokens.append(placeholder)
    for i in np.flatnonzero(computed % block_size == 0).tolist():    # a block became full
        kv.cache_blocks(requests[i], int(computed[i]))
    if not cols.started:
        for request in requests:
            if request.first_token_time is None:
                request.first_token_time = now
        cols.started = True
    ending = np.flatnonzero(computed + 1 >= cols.limits)               # len(token_ids) now
    cols.ready = True
    scheduler._resolving = cols         # its rows get their tokens next (resolve_columns)
    if len(ending):
        for i in ending.tolist():
            if scheduler._check_stop(requests[i], placeholder):
                scheduler.finished_in_update(requests[i], now)
        scheduler.running = [r for r in scheduler.running if r.status is _RUNNING]
        scheduler._columns = cols.kept(_running_rows(requests), scheduler.eos_token_ids)
    scheduler.last_progressed = requests
    return requests


def resolve_columns(scheduler: SchedulerState, requests: list[Request], token_ids: list[int]) -> list[Request] | None:
    """`resolve_placeholders` of the requests a columns update returned, none of them aborted
    since: the tokens written in one pass, the stop tests only for rows whose token is a stop
    token of some row. None: not such a batch (the general loop resolves it)."""
    cols = scheduler._resolving
    if cols is None or requests is not cols.requests:
        return None
    if scheduler.running != requests and _ABORTED in list(map(_STATUS, requests)):
        return None                     # (the general loop skips those rows)
    for outputs, tokens, token_id in zip(cols.outputs, cols.tokens, token_ids):
        outputs[-1] = token_id
        tokens[-1] = token_id
    stop_ids = cols.stop_ids
    if any(map(stop_ids.__contains__, token_ids)):
        for i, token_id in enumerate(token_ids):
            if token_id in stop_ids:
                scheduler.stop_on_resolved(requests[i], token_id)
    return requests


def reads_host_tokens(cols: DecodeColumns | None, requests: list[Request]) -> bool:
    """`Scheduler.reads_host_tokens`: a columns batch answers from its gathered params."""
    if cols is not None and requests is cols.requests:
        return cols.reads_host_tokens
    return any(map(_HOST_TOKENS, map(_PARAMS, requests)))
