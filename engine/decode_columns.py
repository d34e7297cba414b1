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
while it runs (its id, its token lists' objects, prompt + max_tokens), gathered once per
membership of the batch, and (b) the plan of the step (`starts`, `tables`), which
`update_columns` writes into the requests (`num_computed_tokens`, the placeholders) and the next
`schedule` advances by one. (b) is trusted only from a columns update to the next schedule of
the same requests in the same order (`ready`); anything else (a general step, a request that
finished or was aborted, an arrival) rebuilds the columns from the requests.

Readers of `SchedulerOutput.scheduled` that do not know columns see `ScheduledSeq`s exactly as
the general path would have built them (`DecodeSeqs`, built on first read;
`tests/engine/test_decode_columns.py` checks both paths against each other).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from engine.request import Request, RequestStatus
from engine.scheduler_output import PLACEHOLDER_TOKEN_ID, DecodeSeqs, SchedulerOutput

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING
_TOKENS, _OUTPUTS, _COMPUTED, _ID, _PROMPT, _PARAMS, _FIRST_TOKEN = (operator.attrgetter(name) for name in (
    "token_ids", "output_token_ids", "num_computed_tokens", "request_id", "prompt_token_ids", "sampling_params",
    "first_token_time"))
_MAX_TOKENS, _STOP_IDS, _HOST_TOKENS = (operator.attrgetter(name) for name in (
    "max_tokens", "stop_token_ids", "reads_host_tokens"))
_LAST = operator.itemgetter(-1)
# Below this many running requests the general path costs less: a numpy call on a few rows costs
# more (~1 µs) than the Python it replaces.
COLUMNS_MIN_BATCH = 16


class DecodeColumns:
    """The columns of a steady decode batch (module docstring): `requests` in batch order."""

    __slots__ = ("requests", "ids", "outputs", "tokens", "limits", "stop_ids", "reads_host_tokens", "started",
                 "starts", "tables", "num_blocks", "ready")

    def __init__(self, requests: list[Request], max_model_len: int, eos_token_ids: frozenset[int],
                 starts: np.ndarray, tables: list[tuple[int, ...]]) -> None:
        n = len(requests)
        params = list(map(_PARAMS, requests))
        self.requests = requests                   # a list of its own: never changed in place
        self.ids = list(map(_ID, requests))
        self.outputs = list(map(_OUTPUTS, requests))    # the requests' own lists (never replaced)
        self.tokens = list(map(_TOKENS, requests))
        # A length stop once len(token_ids) reaches this (`_check_stop`'s two tests in one).
        limits = np.fromiter(map(len, map(_PROMPT, requests)), np.int64, n)
        limits += np.fromiter(map(_MAX_TOKENS, params), np.int64, n)
        self.limits = np.minimum(limits, max_model_len)
        # The tokens that can end a request when resolved (eos, every member's stop tokens).
        self.stop_ids = eos_token_ids.union(*map(_STOP_IDS, params))
        self.reads_host_tokens = any(map(_HOST_TOKENS, params))
        self.started = None not in list(map(_FIRST_TOKEN, requests))   # every one has its first token
        self.starts = starts
        self.tables = tables
        self.num_blocks = np.fromiter(map(len, tables), np.int64, n)
        self.ready = False              # starts/tables are what the last columns update left

    def owns(self, requests: list[Request], running: list[Request]) -> bool:
        """`requests` is this batch, every one of them still running (C-level: identity compares)."""
        return requests is self.requests and running == requests


def schedule_columns(scheduler: Scheduler, reserved: tuple, finished: tuple) -> SchedulerOutput | None:
    """This step as columns, or None where the general path must plan it (`Scheduler.schedule`
    checked the budget, the pool, the drafts and the queue). Grows the tables that need a block."""
    running = scheduler.running
    cols = scheduler._columns
    if cols is not None and cols.ready and running == cols.requests:
        starts = cols.starts + 1        # the placeholder the last update appended is this step's token
        token_ids = [PLACEHOLDER_TOKEN_ID] * len(running)
        all_placeholders = True
    else:
        cols = None
        tokens = list(map(_TOKENS, running))
        n = len(running)
        starts = np.fromiter(map(_COMPUTED, running), np.int64, n)
        if not (np.fromiter(map(len, tokens), np.int64, n) - starts == 1).all():
            return None                 # a prefill continues: the general path plans this step
        token_ids = list(map(_LAST, tokens))
        all_placeholders = token_ids.count(PLACEHOLDER_TOKEN_ID) == n
    kv = scheduler.kv_manager
    if cols is None:
        tables = list(map(kv.block_tables.__getitem__, map(_ID, running)))
        cols = DecodeColumns(list(running), scheduler.config.max_model_len, scheduler.eos_token_ids, starts, tables)
        scheduler._columns = cols
    tables = list(cols.tables)          # this step's: the output keeps it while the next grows
    num_blocks = cols.num_blocks
    grow = np.flatnonzero(starts >= num_blocks * scheduler.block_size)
    if len(grow):                       # the pool has a block for each (`_decodes_cannot_run_short`)
        requests = cols.requests
        for i in grow.tolist():
            kv.allocate_slots(requests[i], 1)
            tables[i] = kv.block_table(requests[i])
        num_blocks[grow] += 1
    cols.starts, cols.tables, cols.ready = starts, tables, False
    seqs = DecodeSeqs(cols.ids, token_ids, starts, tables, int(num_blocks.max()), all_placeholders)
    out = SchedulerOutput(seqs, len(running), (), reserved, finished)
    scheduler._pending_output, scheduler._pending_requests = out, cols.requests
    return out


def update_columns(scheduler: Scheduler, seqs: DecodeSeqs, now: float) -> list[Request] | None:
    """`update(out, None)` of a columns step: every request one computed token more and a
    placeholder; None (nothing changed) when some request left the batch since `schedule` (the
    general update skips it)."""
    cols = scheduler._columns
    if cols is None or seqs.ids is not cols.ids or scheduler.running != cols.requests:
        return None
    requests, kv, block_size = cols.requests, scheduler.kv_manager, scheduler.block_size
    computed = seqs.starts + 1
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
    if len(ending):
        for i in ending.tolist():
            request = requests[i]
            if scheduler._check_stop(request, placeholder):
                scheduler.finished_in_update(request, now)
        scheduler.running = [r for r in scheduler.running if r.status is _RUNNING]
    else:
        cols.ready = True
    scheduler.last_progressed = requests
    return requests


def resolve_columns(scheduler: Scheduler, requests: list[Request], token_ids: list[int]) -> list[Request] | None:
    """`resolve_placeholders` of a columns batch whose requests all still run: the tokens
    written in one pass, the stop tests only for rows whose token is a stop token of some
    member. None: not such a batch (the general loop resolves it)."""
    cols = scheduler._columns
    if cols is None or not cols.owns(requests, scheduler.running):
        return None
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
