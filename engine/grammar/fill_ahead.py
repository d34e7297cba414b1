"""A CPU engine's next mask rows, filled as soon as the step's tokens are consumed.

On CUDA the forward pass is queued and `StructuredOutputs.prepare` fills the masks while the
device runs it. On a CPU the forward pass blocks the host, so a mask filled in `prepare` adds its
whole time to the step, cache-cold after the forward pass (about 110 µs for the first row
against 30 µs right after its matcher consumed a token). Instead `advance`, where the matchers
have just consumed the step's tokens, starts the next step's fill at once, on one worker thread,
while the engine thread schedules the next step and runs its forward pass (llguidance fills every
row in one call that drops the GIL; torch drops it inside its ops). The thread only helps on a
core torch leaves idle (an earlier fill thread, a call per row, measured slower on a box with no
idle core): with as many torch threads as cores the rows are filled right there in `advance`,
their matchers still in the cache.
`prepare` waits for that fill and keeps the rows that still match: the same request in the same
mask row, with the same matcher at the same output position. Rows that moved (a request left or
joined the batch) are filled again there. With `bounds` the thread also unpacks the rows into
the -inf/+inf bounds the sampler masks with in one op (`kernels.grammar_mask_host`), a few numpy
calls that otherwise run cache-cold in the sampling step.

No matcher may be touched while a fill runs (llguidance borrows it mutably): everything in
`StructuredOutputs` that reads or changes a matcher calls `wait` first.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Sequence

import numpy as np
import torch

from engine.grammar.backend import GrammarBackend, GrammarMatcher
from engine.grammar.request_grammar import RequestGrammar
from kernels.grammar_mask_host import grammar_mask_bounds


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


class FillAhead:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Lock()           # held from a job's start until the thread is done with it
        self._thread: threading.Thread | None = None
        self._pending = False
        self._error: BaseException | None = None
        # What the last start filled, row by row: (state, matcher, num_seen). Empty once used or
        # overwritten: only the last start's rows are fresh, for one prepare.
        self._filled: list[tuple[RequestGrammar, GrammarMatcher, int]] = []
        self._filled_states: Sequence[RequestGrammar] | None = None     # the list the last start was given
        self._num_cores = _num_cores()

    def start(self, backend: GrammarBackend, states: Sequence[RequestGrammar], host: np.ndarray,
              bounds: np.ndarray | None = None) -> None:
        """Fill `host[j]` for `states[j]` (matchers at their newest token), and unpack it into
        `bounds[j]` if given, on the thread while torch leaves a core idle."""
        self.wait()
        matchers = [state.matcher for state in states]
        self._filled = list(zip(states, matchers, [state.num_seen for state in states]))
        self._filled_states = states
        rows = list(zip(matchers, range(len(matchers))))
        if torch.get_num_threads() >= self._num_cores:
            self._run(backend.fill_bitmask, rows, host, bounds)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="cbserve-grammar-fill", daemon=True)
            self._thread.start()
        self._busy.acquire()
        self._pending = True
        self._jobs.put((backend.fill_bitmask_nogil, rows, host, bounds))

    def wait(self) -> None:
        """Until no fill runs (a failed fill raises here, its rows stale)."""
        if self._pending:
            self._busy.acquire()
            self._busy.release()
            self._pending = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def stale(self, states: Sequence[RequestGrammar], untouched: bool = False) -> list[tuple[GrammarMatcher, int]]:
        """A prepare's rows (`states[j]` takes row `j`) that the last `start` did not fill for it;
        after this, every row counts as stale until the next `start`. `untouched`: the caller
        vouches that no matcher was touched since the last start, so when `states` is the very
        list that start was given, nothing is compared (`StructuredOutputs.prepare`'s steady
        batch)."""
        self.wait()
        filled, self._filled = self._filled, []
        given, self._filled_states = self._filled_states, None
        if untouched and states is given and filled:
            return []
        now = list(zip(states, [state.matcher for state in states], [state.num_seen for state in states]))
        if now == filled:       # the usual step: compared in C (states and matchers by identity)
            return []
        return [(entry[1], j) for j, entry in enumerate(now) if j >= len(filled) or entry != filled[j]]

    def close(self) -> None:
        if self._thread is not None:
            self.wait()
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self, fill, rows, host, bounds) -> None:
        try:
            fill(rows, host)
            if bounds is not None:
                grammar_mask_bounds(host, bounds)
        except BaseException as e:      # noqa: BLE001 - raised by the next `wait`
            self._filled = []           # every row filled ahead is stale
            self._filled_states = None
            self._error = e

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            self._busy.release()
