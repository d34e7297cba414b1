"""`BatchScreen`: what a batch's `SamplingParams` ask of the sampler, remembered while the batch stays.

Why: the sampler screens every row's params every step (penalties? min_tokens? logprobs? random
rows?), about 50 µs at batch 256 (`bench/host_step.py`), though a steady decode batch holds the
same requests, in the same order, step after step. The answers depend on the params alone
(frozen values), so `ScreenCache.screen` recomputes them only when the batch's params are not
the very objects of the last batch's: one C-level pass of identity tests. Not `==`: each request
brings its own params object, usually equal to its neighbours' (the defaults), so after a
request leaves, every row behind it compares a different object of equal value, field by field
(~1.5 µs a row: more than screening afresh, `bench/host_step.py --churn`).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from engine.sampling.params import GREEDY_TEMPERATURE_EPS, SamplingParams

_LOGPROBS, _TEMPERATURE, _MIN_TOKENS, _PENALIZED = (
    operator.attrgetter(name) for name in ("logprobs", "temperature", "min_tokens", "penalized"))


class BatchScreen(NamedTuple):
    """A batch's params, screened; rows are indices into the batch (read-only: shared)."""

    penalized: bool           # some row has a repetition/presence/frequency penalty
    min_tokens: bool          # some row has a min_tokens
    logprob_rows: list[int]   # rows that want logprobs
    random_rows: list[int]    # rows that sample (temperature above greedy)


def screen(params: list[SamplingParams]) -> BatchScreen:
    """C-level passes (map/attrgetter), and comprehensions only for the rows they flag."""
    wanted = list(map(_LOGPROBS, params))
    temperatures = list(map(_TEMPERATURE, params))
    return BatchScreen(
        any(map(_PENALIZED, params)), any(map(_MIN_TOKENS, params)),
        [] if wanted.count(None) == len(wanted) else [i for i, n in enumerate(wanted) if n is not None],
        [] if max(temperatures, default=0.0) < GREEDY_TEMPERATURE_EPS else [
            i for i, t in enumerate(temperatures) if t >= GREEDY_TEMPERATURE_EPS])


class ScreenCache:
    """The last batch's screen, reused while the params are the same."""

    def __init__(self) -> None:
        self._params: list[SamplingParams] | None = None
        self._screen: BatchScreen | None = None

    def screen(self, params: list[SamplingParams]) -> BatchScreen:
        last = self._params
        if last is None or len(params) != len(last) or not all(map(operator.is_, params, last)):
            self._params, self._screen = params, screen(params)
        return self._screen
