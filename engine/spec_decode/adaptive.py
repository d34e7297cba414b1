"""When to speculate, and how far: from each request's acceptance and the engine's measured step costs.

Two decisions, both from measurements, none from a constant threshold:

1. **Per batch size, on or off.** Decode steps are timed as they run (the seconds `Engine.step`
   took, as `_record_step` sees them). For each batch-size bucket (powers of two) the controller
   keeps the realised output rate, tokens emitted per second, of plain decode steps and of
   speculative ones, and speculates where the speculative rate is the higher. That includes every
   cost speculation adds (proposing, the draft model's passes, the longer verification forward,
   the sampler's extra rows, and on a GPU the overlap a speculative step gives up), so as the
   batch grows and the forward turns compute-bound speculation turns itself off. The mode not
   chosen is probed now and then to keep its rate current: after `MIN_PROBE_INTERVAL` steps, an
   interval that doubles (to `MAX_PROBE_INTERVAL`) each time a probe confirms the choice, so a
   losing mode costs at most one step in `MAX_PROBE_INTERVAL` once settled. A bucket starts on.

2. **Per request, how many drafts.** A request's draft `j` is used only if drafts `1..j` are
   all accepted: with per-draft acceptance `alpha` (the geometric estimate from its verifications:
   accepted drafts / (accepted + first rejections), decayed), it is worth `alpha ** j` tokens.
   It costs the extra step time one draft token adds, worth `cost * rate` tokens at the plain
   rate: per bucket, the extra seconds of speculative steps over plain ones are fitted as
   `overhead + cost * draft_tokens` (least squares, decayed), so a step's fixed costs (proposing,
   sampling, lost overlap) do not make drafts look dear when few are proposed. So a request
   proposes the drafts with `alpha ** j > cost * rate`, at most `num_speculative_tokens`. One whose
   estimate falls to no draft retries a single draft after a backoff (doubling to 64 steps), or it
   could never recover.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 256
RATE_ALPHA = 0.2                # EWMA weight of a new step's rate
ACCEPTANCE_DECAY = 0.9          # per verification: a request's recent drafts count most
PRIOR_ACCEPTANCE = 0.6          # before a request's first verification
PRIOR_TRIALS = 2.0
PRIOR_TOKEN_COST = 0.05         # tokens a draft token costs before the bucket has both rates
MAX_RETRY_BACKOFF = 64


def _ewma(old: float | None, new: float, alpha: float = RATE_ALPHA) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class _Bucket:
    on: bool = True
    plain_rate: float | None = None      # tokens / second of plain decode steps
    plain_seconds: float | None = None   # seconds per plain decode step
    spec_rate: float | None = None       # tokens / second of speculative decode steps
    fit: _LineFit | None = None          # extra seconds of a speculative step ~ overhead + cost * drafts
    countdown: int = MIN_PROBE_INTERVAL  # steps until the other mode is probed
    interval: int = MIN_PROBE_INTERVAL
    probing: bool = False

    def token_cost(self) -> float:
        """Tokens of plain output one draft token's extra step time is worth."""
        if self.fit is None or self.plain_rate is None:
            return PRIOR_TOKEN_COST
        return self.fit.slope() * self.plain_rate


class _LineFit:
    """Least-squares line `y ~ a + b x` over decayed samples."""

    __slots__ = ("n", "sx", "sy", "sxx", "sxy")
    DECAY = 0.95

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def slope(self) -> float:
        """b, at least 0; with no spread in x (every step the same drafts) all of y is charged to x."""
        var = self.n * self.sxx - self.sx * self.sx
        if var > 1e-9 * max(1.0, self.sxx * self.n):
            return max(0.0, (self.n * self.sxy - self.sx * self.sy) / var)
        return max(0.0, self.sy / self.sx) if self.sx > 0 else 0.0


class _Acceptance:
    __slots__ = ("accepted", "trials", "retry_in", "backoff", "__weakref__")

    def __init__(self) -> None:
        self.accepted, self.trials = PRIOR_ACCEPTANCE * PRIOR_TRIALS, PRIOR_TRIALS
        self.retry_in = self.backoff = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials


def bucket_of(batch_size: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: one bucket per power of two."""
    return batch_size.bit_length()


class SpecController:
    """The adaptive policy of one engine's speculation (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.max_drafts = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self._buckets: dict[int, _Bucket] = {}
        self._requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        found = self._buckets.get(key)
        if found is None:
            found = self._buckets[key] = _Bucket()
        return found

    # ------------------------------------------------------------------ decisions
    def wants_step(self, batch_size: int) -> bool:
        """Whether the next step (about `batch_size` running requests) speculates."""
        if batch_size < 1 or (self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size):
            return False
        b = self.bucket(batch_size)
        b.countdown -= 1
        if b.countdown <= 0:
            b.countdown, b.probing = b.interval, True
            return not b.on
        return b.on

    def num_drafts(self, request, batch_size: int, limit: int) -> int:
        """Drafts to propose for `request` this step (0: none), at most `limit`."""
        limit = min(limit, self.max_drafts)
        if limit <= 0:
            return 0
        state = self._requests.get(request)
        if state is None:
            state = self._requests[request] = _Acceptance()
        cost = self.bucket(batch_size).token_cost()
        alpha = state.alpha
        if cost <= 0 or alpha >= 1.0:
            num = limit
        elif alpha <= cost or alpha <= 0.0:
            num = 0
        else:
            num = min(limit, int(math.log(cost) / math.log(alpha)))
        if num > 0:
            state.backoff = 0
            return num
        if state.retry_in > 0:
            state.retry_in -= 1
            return 0
        state.backoff = min(MAX_RETRY_BACKOFF, max(1, 2 * state.backoff))
        state.retry_in = state.backoff
        return 1

    # ------------------------------------------------------------------ measurements
    def observe_acceptance(self, request, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted `num_accepted` of them."""
        state = self._requests.get(request)
        if state is None:
            state = self._requests[request] = _Acceptance()
        rejected = 1.0 if num_accepted < num_drafts else 0.0
        state.accepted = ACCEPTANCE_DECAY * state.accepted + num_accepted
        state.trials = ACCEPTANCE_DECAY * state.trials + num_accepted + rejected

    def observe_step(self, num_seqs: int, seconds: float, num_emitted: int, num_draft_tokens: int,
                     speculative: bool) -> None:
        """A decode-only step (no prefill chunk) of `num_seqs` requests took `seconds` and emitted
        `num_emitted` tokens; `speculative`: it ran as a speculative step (with `num_draft_tokens`
        drafts, possibly none)."""
        if num_seqs < 1 or seconds <= 0:
            return
        b = self.bucket(num_seqs)
        rate = num_emitted / seconds
        if speculative:
            b.spec_rate = _ewma(b.spec_rate, rate)
            if b.plain_seconds is not None:
                if b.fit is None:
                    b.fit = _LineFit()
                b.fit.add(num_draft_tokens, seconds - b.plain_seconds)
        else:
            b.plain_rate = _ewma(b.plain_rate, rate)
            b.plain_seconds = _ewma(b.plain_seconds, seconds)
        if b.spec_rate is None or b.plain_rate is None:
            return
        on = b.spec_rate > b.plain_rate
        if on != b.on:
            b.on, b.interval, b.countdown = on, MIN_PROBE_INTERVAL, MIN_PROBE_INTERVAL
        elif b.probing:
            b.interval = min(MAX_PROBE_INTERVAL, 2 * b.interval)
            b.countdown = b.interval
        b.probing = False


class FixedController(SpecController):
    """Always speculate, always the most drafts: for tests of the verification path and for
    benchmarks that separate acceptance from the adaptive policy (never the engine's default)."""

    def wants_step(self, batch_size: int) -> bool:
        return batch_size >= 1

    def num_drafts(self, request, batch_size: int, limit: int) -> int:
        return max(0, min(limit, self.max_drafts))
