"""When to speculate, and how far: from each request's acceptance and the engine's measured step costs.

Two decisions, both from measurements, none from a constant threshold:

1. **Per batch size, on or off.** Decode steps are timed as they run (the seconds `Engine.step`
   took, as `_record_step` sees them: host work included; a step that wanted drafts and found none
   counts as speculative, so proposing that finds nothing is charged to speculation). That cost
   includes everything speculation adds (proposing, the draft model's passes and lazy catch-up,
   the longer verification forward, the sampler's extra rows, the overlap a synchronous step gives
   up), so as the batch grows and the forward turns compute-bound speculation turns itself off.
   - **Paired samples.** A shared host's load moves step costs 2-3x within seconds, so costs of
     the two modes measured at different times say little about each other. So the controller
     compares a tested step (a learning step's speculative one, a probe) with the steps of the
     other mode *just before it* (at most `PAIR`): each sample is the ratio of their costs per
     emitted token, speculative / plain, and the last `WINDOW` ratios' *median* decides (one slow
     step moves one ratio by one rank). Each bucket (powers of two of the batch size) decides for
     itself.
   - **A pair is one run of steps**: the engine's consecutive steps (no step with a prefill chunk,
     none of another bucket between them) over the same number of requests. A closed batch's
     tail (requests finishing, the batch shrinking a few requests a step) runs a few steps in each
     smaller bucket, then none for as long as the next batch takes: paired across that gap, or
     across sizes (a plain step of 14 requests against a speculative one of 8: the fixed cost per
     token differs by 1.75x), a ratio said more about the gap than about speculation, and tail
     buckets turned on where speculation lost (`edit` at batch 32 and 128). So a tested step is
     taken only where it pairs: a learning step or a probe waits for a step of the other mode
     just before it over as many requests.
   - A new bucket alternates the modes, plain first (a speculative learning step only right after
     a plain step it pairs with), and decides off once it has `MIN_SAMPLES` ratios whose median
     does not pass the margin, on only from `MIN_RATIOS_ON` (a wrong "on" costs every step until a
     probe corrects it; a wrong "off" only the saving, until a probe finds it). Steps with a
     prefill chunk are not timed: they speculate only where the bucket decided to.
   - Hysteresis: speculation goes on only when the median ratio is `SWITCH_MARGIN` below 1, and off
     as soon as it is not below 1. Where the two are close the bucket stays plain.
   - Fruitless steps decide without timing: a speculative step that accepted no draft (none
     proposed: no n-gram matched; or all rejected) emitted what a plain step emits, at more cost,
     so it is evidence against speculation whatever the clock says. `MIN_SAMPLES` of them in a
     row turn a new bucket off (or keep an off one off: a fruitless probe agrees), `WINDOW` of
     them an on one (at an acceptance of one half, 3 in a row are common), and while the last
     speculative step was fruitless the timing cannot turn it on.
   - The mode not chosen is probed, one step at a time, to keep the ratios current: every
     `FIRST_PROBE_INTERVAL` steps after a decision, an interval that doubles (to
     `MAX_PROBE_INTERVAL`) each time a probe agrees with the choice; a probe that disagrees brings
     it back to the first, so a change of workload shows within a few.
   - **Probes are paid from a budget**: a probe's cost is its extra seconds over what the chosen
     mode's steps before it would have taken for its tokens, and a probe that is due waits until
     all probes' cost so far, plus what the last one cost, fits in `PROBE_BUDGET` of the decode
     seconds observed (one budget for all buckets; a probe that beat the chosen mode pays back
     what it saved). A cheap probe (an n-gram lookup) runs on
     schedule; a dear one (a draft model's or EAGLE head's catch-up over every token since its last
     proposal, 3-6x a plain step on `tiny`) runs rarely, so probing stays under ~1% of the time.
     The budget holds since the last probe too (a probe waits until its expected cost fits in
     `PROBE_BUDGET` of the decode seconds since the last probe that cost something), so a quiet
     while's savings are not spent in a burst of probes. Learning steps are not charged: they run
     once per bucket in the engine's life.
   - **Shadow drafts gate n-gram probes** (`engine.spec_decode.shadow`): a plain step emits a
     point-mass draft `d` with the probability verification would accept it, so when a probe of
     speculation is due in an off bucket the n-gram proposer is run (a lookup) and its drafts are
     later compared with what the plain steps emitted: each request's acceptance estimate stays
     current without a verification. The pass also predicts the speculative step now (draft tokens,
     expected accepted tokens); with the bucket's plain cost per token and its fitted extra seconds
     (`overhead + cost * drafts`, below) the probe runs only where that predicts a lower cost per
     token, else it waits the interval again. A free-like stream (no match, or matches that are
     rejected) runs no timed probe; the prediction never turns a bucket on (the paired ratios of the
     probes it lets through do). Such a probe proposes only for requests with a match, as many drafts
     as their estimate justifies, with no retries (the estimates are current).

   - **Each step is priced** (`SpecController.declines`): in a decided bucket a step's drafts,
     once proposed, run only where their expected accepted tokens pay the extra seconds the fit
     predicts (the shadow drafts' rule, on real drafts); else the step runs plain and is timed as
     one. At a medium batch an "on" bucket's steps differ: a few requests matching pay the fixed
     cost of a speculative step for a token or two, most matching gain. `WINDOW` declines in a row
     turn the bucket off (the lookups cost more than the rare step that pays; probes find those)
     and clear its paired ratios: they said on, and kept, the next plain step would turn the
     bucket straight back on, every step still declined.

2. **Per request, how many drafts.** A request's draft `j` is used only if drafts `1..j` are
   all accepted: with per-draft acceptance `alpha` (the geometric estimate from its verifications:
   accepted drafts / (accepted + first rejections), decayed), it is worth `alpha ** j` tokens.
   A new request's estimate starts at the engine's recent acceptance (every request's
   verifications, decayed more slowly): its workload is most likely the one before it. A fixed
   prior deadlocked: a closed batch of 8 copying requests (acceptance 1.00) started at 0.6, which
   justified 2 drafts a request, 7.7 expected tokens in all that did not pay for the step, so every step
   was declined and no request was ever verified (a round at 1.00x plain TPOT between rounds at 0.5x).
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

WINDOW = 8                      # recent paired cost ratios whose median decides
PAIR = 3                        # a step's cost is paired with at most this many steps of the other mode just before it
MIN_SAMPLES = 3                 # steps of each mode (and paired ratios) before a bucket's first decision
MIN_RATIOS_ON = 5               # paired ratios before a new bucket's first decision can be "on"
SWITCH_MARGIN = 0.03            # speculation goes on only this much cheaper per token than plain
FIRST_PROBE_INTERVAL = 16       # steps between probes of the mode not chosen, right after a decision
MAX_PROBE_INTERVAL = 256
PROBE_BUDGET = 0.01             # probes' extra seconds stay under this share of all decode seconds
ACCEPTANCE_DECAY = 0.9          # per verification: a request's recent drafts count most
PRIOR_ACCEPTANCE = 0.6          # before the engine's first verification
PRIOR_TRIALS = 2.0              # the weight of a request's prior: the engine's recent acceptance
POPULATION_DECAY = 0.99         # per verification: the engine's recent acceptance, every request's drafts
PRIOR_TOKEN_COST = 0.05         # tokens a draft token costs before the bucket has both rates
MAX_RETRY_BACKOFF = 64


def _window(size: int = WINDOW) -> deque:
    return deque(maxlen=size)


class _ProbeBudget:
    """What probes cost beyond the chosen mode, against every decode step's seconds (one per
    controller: all buckets' probes share it). Two bounds: since the start, and since the last
    probe (so savings from a quiet while are not spent in a burst: a window of decode seconds that
    starts at a probe holds at most one probe's cost beyond `PROBE_BUDGET` of it)."""

    __slots__ = ("spent", "elapsed", "last_probe")

    def __init__(self) -> None:
        self.spent = self.elapsed = 0.0
        self.last_probe = -math.inf      # `elapsed` at the last probe that cost something

    def allows(self, expected: float) -> bool:
        return (self.spent + expected <= PROBE_BUDGET * self.elapsed
                and expected <= PROBE_BUDGET * (self.elapsed - self.last_probe))

    def charge(self, extra: float) -> None:
        """A probe's extra seconds over the chosen mode (negative: it saved)."""
        self.spent = max(0.0, self.spent + extra)
        if extra > 0:
            self.last_probe = self.elapsed


@dataclass
class _Bucket:
    budget: _ProbeBudget = field(default_factory=_ProbeBudget)
    on: bool = True                      # the chosen mode (until `decided`, the modes alternate)
    decided: bool = False
    num_plain: int = 0                   # steps observed per mode (for the learning steps)
    num_spec: int = 0
    recent: deque = field(default_factory=lambda: _window(PAIR))   # (speculative, seconds per token), this run's latest steps
    run_seqs: int = 0                    # the run `recent` holds: its requests per step and its last step's clock
    run_clock: int = -1
    ratios: deque = field(default_factory=_window)       # speculative / plain seconds per token, paired in time
    plain: deque = field(default_factory=_window)        # seconds per emitted token, plain steps
    plain_steps: deque = field(default_factory=_window)  # seconds per plain step
    fit: _LineFit | None = None          # extra seconds of a speculative step ~ overhead + cost * drafts
    countdown: int = FIRST_PROBE_INTERVAL   # steps until the mode not chosen is probed
    interval: int = FIRST_PROBE_INTERVAL
    probing: bool = False
    probe_cost: float = 0.0              # extra seconds the last probe cost: what the next is expected to
    fruitless: int = 0                   # speculative steps in a row that accepted no draft
    declined: int = 0                    # steps in a row whose drafts `SpecController.declines` ran plain
    cost: float | None = None            # `token_cost` until the next step is observed

    def token_cost(self) -> float:
        """Tokens of plain output one draft token's extra step time is worth (asked once per request
        and step, so kept until a step changes what it is computed from)."""
        if self.cost is None:
            self.cost = PRIOR_TOKEN_COST if self.fit is None or not self.plain else \
                self.fit.slope() / median(self.plain)
        return self.cost

    def _after(self, num_seqs: int, clock: int) -> bool | None:
        """The mode of the step just before `clock` if it was this bucket's over `num_seqs`
        requests (a step at `clock` pairs with it), else None."""
        if not self.recent or self.run_clock != clock - 1 or self.run_seqs != num_seqs:
            return None
        return self.recent[-1][0]

    def choose(self, num_seqs: int, clock: int, predict: Callable[[], tuple[int, float]] | None = None) -> bool:
        """Whether step `clock` (over `num_seqs` requests) speculates, counting it towards the next
        probe. A tested step waits for a step it pairs with (the other mode's, just before it, over
        as many requests); a probe due also waits while the budget cannot pay what the last one cost.
        A probe of speculation that is due asks `predict` (shadow drafts, `engine.spec_decode.shadow`,
        asked only then: its pass costs a lookup per request) and where it predicts a loss runs no
        probe, waiting the interval again (not doubled: no probe agreed)."""
        if not self.decided:      # plain first: each speculative learning step right after one it pairs with
            return self._after(num_seqs, clock) is False
        self.countdown -= 1
        if self.countdown <= 0 and self._after(num_seqs, clock) is self.on and self.budget.allows(self.probe_cost):
            if not self.on and predict is not None and not self.predicts_gain(num_seqs, *predict()):
                self.countdown = self.interval
                return False
            self.countdown, self.probing = self.interval, True
            return not self.on
        return self.on

    def predicts_gain(self, num_seqs: int, num_drafts: int, expected: float) -> bool:
        """Whether a speculative step over `num_seqs` requests with `num_drafts` draft tokens that
        add `expected` accepted tokens would cost less per token than the plain steps: from the
        bucket's plain cost per token and its fitted extra seconds (`overhead + cost * drafts`,
        each at least 0; none fitted yet: any expected gain is worth a probe, which fits them)."""
        if expected <= 0:
            return False
        if not self.plain or self.fit is None:
            return True
        plain_step = median(self.plain) * num_seqs
        extra = max(0.0, self.fit.intercept()) + self.fit.slope() * num_drafts
        return (plain_step + extra) / (num_seqs + expected) < plain_step / num_seqs

    def _pair(self, speculative: bool, seconds: float, emitted: int, num_seqs: int,
              clock: int) -> tuple[float, float] | None:
        """The step's speculative / plain cost ratio against the other mode's steps just before it
        in its run, and its extra seconds over what they would have taken (None after a step of
        its own mode, or as a run's first step)."""
        if self._after(num_seqs, clock) is None:     # a new run: what came before is another moment
            self.recent.clear()
        self.run_seqs, self.run_clock = num_seqs, clock
        run = []
        for mode, cost in reversed(self.recent):
            if mode == speculative:
                break
            run.append(cost)
        cost = seconds / emitted
        self.recent.append((speculative, cost))
        if not run:
            return None
        ref = median(run)
        return (cost / ref if speculative else ref / cost), seconds - emitted * ref

    def decide(self, on: bool) -> None:
        """The bucket's mode is now `on`: probes of the other start again at the first interval."""
        self.on, self.decided, self.declined = on, True, 0
        self.interval = self.countdown = FIRST_PROBE_INTERVAL

    def observe(self, speculative: bool, seconds: float, emitted: int, fruitless: bool = False,
                num_seqs: int = 0, clock: int = 0) -> None:
        """Step `clock` over `num_seqs` requests took `seconds` and emitted `emitted` tokens: the
        mode, and when to probe next. `fruitless`: a speculative step that accepted no draft."""
        probe, self.probing = self.probing and speculative != self.on, False
        paired = self._pair(speculative, seconds, emitted, num_seqs, clock)
        # One ratio per tested step (a learning step's speculative one, a probe), so an outlier
        # step moves one ratio, not the two of its neighbours.
        ratio = None if paired is None or not (probe or speculative and not self.decided) else paired[0]
        if ratio is not None:
            self.ratios.append(ratio)
        if probe and paired is not None:   # a probe that beat the chosen mode pays back what it saved
            self.probe_cost = max(0.0, paired[1])
            self.budget.charge(paired[1])
        if speculative:
            self.num_spec += 1
            self.fruitless = self.fruitless + 1 if fruitless else 0
        else:
            self.num_plain += 1
        # Nothing accepted lately: plain emits the same for less. A bucket that chose speculation
        # needs a window of them (a request's run of rejections is no trend; 3 in a row are common
        # at an acceptance of one half), a new or plain one MIN_SAMPLES.
        if self.fruitless >= (WINDOW if self.decided and self.on else MIN_SAMPLES):
            if not self.decided or self.on:
                self.decide(False)
            elif probe:
                self.interval = self.countdown = min(MAX_PROBE_INTERVAL, 2 * self.interval)
            return
        if self.num_spec < MIN_SAMPLES or self.num_plain < MIN_SAMPLES or len(self.ratios) < MIN_SAMPLES:
            return
        r = median(self.ratios)
        on = r < 1 if self.decided and self.on else r < 1 - SWITCH_MARGIN and not self.fruitless
        if not self.decided and on and len(self.ratios) < MIN_RATIOS_ON:
            return                         # on needs more evidence than off (the module docstring)
        if not self.decided or on != self.on:
            self.decide(on)
        elif probe and ratio is not None:   # agreeing: the probed mode cost more than the chosen one
            agrees = ratio >= 1 - SWITCH_MARGIN if speculative else ratio < 1
            self.interval = min(MAX_PROBE_INTERVAL, 2 * self.interval) if agrees else FIRST_PROBE_INTERVAL
            self.countdown = self.interval


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

    def intercept(self) -> float:
        """a, the fixed extra of a step (0 where `slope` charged all of y to x)."""
        var = self.n * self.sxx - self.sx * self.sx
        if var > 1e-9 * max(1.0, self.sxx * self.n):
            return (self.sy - self.slope() * self.sx) / self.n
        return 0.0 if self.sx > 0 or self.n <= 0 else self.sy / self.n


class _Acceptance:
    """A geometric per-draft acceptance estimate: accepted drafts / (accepted + first rejections),
    each verification's counts decayed, from a prior worth `PRIOR_TRIALS` verifications."""

    __slots__ = ("accepted", "trials", "retry_in", "backoff", "__weakref__")

    def __init__(self, prior: float = PRIOR_ACCEPTANCE) -> None:
        self.accepted, self.trials = prior * PRIOR_TRIALS, PRIOR_TRIALS
        self.retry_in = self.backoff = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        rejected = 1.0 if num_accepted < num_drafts else 0.0
        self.accepted = decay * self.accepted + num_accepted
        self.trials = decay * self.trials + num_accepted + rejected


def expected_accepted(alpha: float, num_drafts: int) -> float:
    """Tokens `num_drafts` drafts at per-draft acceptance `alpha` add in expectation: draft `j`
    counts only if drafts `1..j` are all accepted, so `alpha + alpha ** 2 + ... + alpha ** k`."""
    return alpha * (1 - alpha ** num_drafts) / (1 - alpha) if alpha < 1 else float(num_drafts)


def bucket_of(batch_size: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: one bucket per power of two."""
    return batch_size.bit_length()


class SpecController:
    """The adaptive policy of one engine's speculation (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.max_drafts = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self._buckets: dict[int, _Bucket] = {}
        self._budget = _ProbeBudget()
        self._requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Every request's verifications: a new request's prior (its workload is most likely the
        # engine's recent one: the copying requests of a batch accept nearly all, free ones nearly none).
        self._population = _Acceptance()
        # Engine steps so far (`wants_step` is asked once a step; an observation without one, as in
        # tests that feed costs alone, counts as a step): pairs come only from consecutive steps.
        self._clock = 0
        self._asked = False

    def bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        found = self._buckets.get(key)
        if found is None:
            found = self._buckets[key] = _Bucket(self._budget)
        return found

    # ------------------------------------------------------------------ decisions
    def _speculates_at(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests may speculate at all (`disable_by_batch_size`)."""
        return batch_size >= 1 and (self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size)

    def wants_step(self, batch_size: int, mixed: bool = False,
                   predict: Callable[[], tuple[int, float]] | None = None) -> bool:
        """Whether the next step (about `batch_size` running requests) speculates. `mixed`: it
        will carry a prefill chunk, so its time says nothing about decode costs (it is not
        observed): it speculates only where the bucket has decided on speculation, and neither
        learns nor probes. `predict()`: (draft tokens, expected accepted tokens) of a speculative
        step now, from shadow drafts (where `shadows` says so), asked when a probe of speculation
        is due: the probe runs only where it predicts a gain."""
        self._clock += 1
        self._asked = True
        if not self._speculates_at(batch_size):
            return False
        b = self.bucket(batch_size)
        return b.decided and b.on if mixed else b.choose(batch_size, self._clock, predict)

    def shadows(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests would run plain by choice (a decided, off
        bucket): where shadow drafts measure acceptance and predict probes."""
        if not self._speculates_at(batch_size):
            return False
        b = self._buckets.get(bucket_of(batch_size))
        return b is not None and b.decided and not b.on

    def declines(self, batch_size: int, drafted) -> bool:
        """Whether a step of a decided bucket should run plain although it found drafts
        (`drafted`: (request, its draft count) pairs): their expected accepted tokens (each
        request's `alpha + ... + alpha ** k`) do not pay the extra seconds the bucket's fit predicts
        (`_Bucket.predicts_gain`). An "on" bucket's steps are not alike: at a medium batch a step
        where a few requests matched pays the speculative step's fixed cost for a token or two, one
        where most matched gains; so each step is priced, the bucket's mode only says whether to
        look. Learning steps are never declined (they fit the costs). `WINDOW` declines in a row
        turn an "on" bucket off: looking (a lookup per request a step) costs more than the rare
        step that pays, which the off bucket's probes, gated by shadow drafts, still find."""
        b = self.bucket(batch_size)
        if not b.decided:
            return False
        num_drafts, expected = 0, 0.0
        for request, k in drafted:
            alpha = self._acceptance(request).alpha
            num_drafts += k
            expected += expected_accepted(alpha, k)
        if b.predicts_gain(batch_size, num_drafts, expected):
            b.declined = 0
            return False
        b.declined += 1
        if b.on and b.declined >= WINDOW:
            b.decide(False)
            b.ratios.clear()    # the paired ratios said on; the prices say no step pays: probes start afresh
        return True

    def justified_drafts(self, request, cost: float, limit: int) -> tuple[int, float]:
        """(drafts worth proposing for `request` at `cost` tokens per draft token, at most `limit`;
        its acceptance estimate): the drafts `j` with `alpha ** j > cost`."""
        alpha = self._acceptance(request).alpha
        if limit <= 0:
            return 0, alpha
        if cost <= 0 or alpha >= 1.0:
            return limit, alpha
        if alpha <= cost or alpha <= 0.0:
            return 0, alpha
        return min(limit, int(math.log(cost) / math.log(alpha))), alpha

    def num_drafts(self, request, batch_size: int, limit: int, retry: bool = True) -> int:
        """Drafts to propose for `request` this step (0: none), at most `limit`. `retry`: a request
        whose estimate gives no draft retries one now and then (else, unverified, its estimate could
        never recover); not needed where shadow drafts keep the estimate current."""
        limit = min(limit, self.max_drafts)
        if limit <= 0:
            return 0
        num, _ = self.justified_drafts(request, self.bucket(batch_size).token_cost(), limit)
        state = self._requests[request]
        if num > 0:
            state.backoff = 0
            return num
        if not retry:
            return 0
        if state.retry_in > 0:
            state.retry_in -= 1
            return 0
        state.backoff = min(MAX_RETRY_BACKOFF, max(1, 2 * state.backoff))
        state.retry_in = state.backoff
        return 1

    # ------------------------------------------------------------------ measurements
    def observe_acceptance(self, request, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted `num_accepted` of them."""
        self._acceptance(request).observe(num_drafts, num_accepted, ACCEPTANCE_DECAY)
        self._population.observe(num_drafts, num_accepted, POPULATION_DECAY)

    def _acceptance(self, request) -> _Acceptance:
        """`request`'s estimate; a new one starts from the engine's recent acceptance."""
        state = self._requests.get(request)
        if state is None:
            state = self._requests[request] = _Acceptance(self._population.alpha)
        return state

    def observe_step(self, num_seqs: int, seconds: float, num_emitted: int, num_draft_tokens: int,
                     speculative: bool) -> None:
        """A decode-only step (no prefill chunk) of `num_seqs` requests took `seconds` and emitted
        `num_emitted` tokens; `speculative`: it ran as a speculative step (with `num_draft_tokens`
        drafts, possibly none)."""
        if not self._asked:
            self._clock += 1
        self._asked = False
        if num_seqs < 1 or seconds <= 0 or num_emitted < 1:
            return
        b = self.bucket(num_seqs)
        b.cost = None
        self._budget.elapsed += seconds
        if speculative:
            if b.plain_steps:
                if b.fit is None:
                    b.fit = _LineFit()
                b.fit.add(num_draft_tokens, seconds - median(b.plain_steps))
        else:
            b.plain.append(seconds / num_emitted)
            b.plain_steps.append(seconds)
        b.observe(speculative, seconds, num_emitted, fruitless=speculative and num_emitted <= num_seqs,
                  num_seqs=num_seqs, clock=self._clock)


class FixedController(SpecController):
    """Always speculate, always the most drafts: for tests of the verification path and for
    benchmarks that separate acceptance from the adaptive policy (never the engine's default)."""

    def wants_step(self, batch_size: int, mixed: bool = False, predict=None) -> bool:
        return batch_size >= 1

    def shadows(self, batch_size: int) -> bool:
        return False

    def declines(self, batch_size: int, drafted) -> bool:
        return False

    def num_drafts(self, request, batch_size: int, limit: int, retry: bool = True) -> int:
        return max(0, min(limit, self.max_drafts))
