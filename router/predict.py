"""Latency predictors: TTFT on a prefill pod, TPOT on a decode pod, from the pods' own reports.

TTFT: the prompt waits behind the pod's queued prefill tokens, then its own uncached tokens are
computed. The pod computes that work in engine steps of at most `max_num_batched_tokens` tokens,
so the TTFT is the time of those steps, each priced by the pod's step-time model (below):
    steps = ceil((queued_prefill_tokens + uncached_tokens) / max_num_batched_tokens)
    ttft  = Σ step_seconds(num_seqs, context, tokens of that step)
A step has a fixed cost besides its tokens, and short prompts (or prompts mostly in the prefix
cache) are all fixed cost: sixteen of them share one step. A tokens-per-second rate measured on
such steps (the pods' `prefill_tokens_per_second`) is low and swings with whatever ran last, and a
queue divided by it predicted a burst of short requests seconds late, so admission shed it one run
and not the next (issue 20). Until the model has samples a step costs the pod's reported step-time
EWMA; the rate is the last resort, for a pod that has not stepped yet:
    ttft = (queued_prefill_tokens + uncached_tokens) / prefill_tokens_per_second
TPOT: one decode step runs every sequence of the batch, so the time per output token is the step
time at the batch the pod will have with this request added. The step time is fitted online from
the (num_seqs, num_context_tokens, num_prefill_tokens, seconds) samples each pod reports:
    seconds ≈ a + b·n + Σ_k c_k·max(0, n - k) + d·context_tokens + e·prefill_tokens
a linear spline in the batch size n (knots k = 2, 4, …, 128: each batch-size range gets its own
slope, since step time is not linear in n, e.g. convex on a CPU), fitted by least squares over
exponentially forgotten normal equations (old batches fade as the pod's behaviour drifts), with a
small ridge term so a few collinear samples still give an answer; the knot terms get a larger one,
so a range without samples keeps the slope of the range below it.

The step model predicts the mean model step; what a client sees is a high quantile of its whole
TPOT, which also holds the gaps between steps (loop overhead), the batch growing after admission,
and, with P/D, the hand-over: P's first token, then the KV pull and D's first step before D's
first new token (`pd_gap`). The prediction spreads the decode pod's typical hand-over (the median
of its recent ones, `RecentQuantile`) over the request's tokens (`client_tpot`): left to the
calibration alone, an 8-token answer's hand-over pinned the factor at its cap and priced every long
answer three times too slow. `LatencyCalibration` closes the rest per decode pod from the router's
own measurements: a quantile of observed / predicted TPOT over recent requests, a factor the
prediction is multiplied by. TTFT gets the same, per prefill pod, from observed / predicted time
from routing to the first token.

Which quantile. The goodput policy admits a request when its calibrated prediction meets the
SLO, so a pod fills until the calibrated prediction is at the SLO, and the quantile is then the
share of its requests that meet it. At the median, half of a full pod's requests missed, and past
the knee which half swung with the machine's noise: a lone colocated pod finished 11 req/s and
served 1.2-6.5 of them within SLO (session 17, `docs/benchmarks.md`, "Admission past the knee").
A high quantile in turn refuses what could have met, and a refused request is a miss for certain:
at the 95th percentile, with a prefill pod's load still counting every sequence it had handed to
decode, the P/D cluster refused 80-86% of requests at 10-16 req/s (`docs/benchmarks.md`,
"Admission calibration"). TPOT is calibrated at the 80th percentile, TTFT at the 90th (a late first
token is late for the whole answer), and a prefill pod counts only the prefills it still has to
answer (`router.load.PodState.num_requests`).
"""

from __future__ import annotations

from collections import deque

SEQ_KNOTS = (2, 4, 8, 16, 32, 64, 128)
NUM_FEATURES = 4 + len(SEQ_KNOTS)     # 1, n, one hinge per knot, context, prefill
# Features are scaled to comparable magnitudes so the ridge term treats them alike.
_CONTEXT_SCALE = 1e-3
_PREFILL_SCALE = 1e-3
_HINGES = range(2, 2 + len(SEQ_KNOTS))


def _features(num_seqs: float, num_context_tokens: float, num_prefill_tokens: float) -> list[float]:
    n = float(num_seqs)
    return [1.0, n, *(max(0.0, n - k) for k in SEQ_KNOTS),
            num_context_tokens * _CONTEXT_SCALE, num_prefill_tokens * _PREFILL_SCALE]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system; None if singular."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                if factor:
                    for c in range(col, n + 1):
                        a[r][c] -= factor * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


class StepTimeModel:
    """Online model of a pod's mean step time; `predict` returns seconds per step."""

    # A sample this many times the fitted prediction is a pause (a SIGSTOP, a swap storm, the
    # machine's other tenants), not the pod's speed: one such 10 s step among 10 ms ones would move
    # the least-squares fit for hundreds of steps. It is dropped, unless `OUTLIER_RUN` come in a
    # row: then the pod really is that slow now, and the model follows.
    OUTLIER_FACTOR = 10.0
    OUTLIER_RUN = 4

    def __init__(self, forgetting: float = 0.995, ridge: float = 1e-6, knot_ridge: float = 1.0,
                 min_samples: int = 8, prefill_ridge: float = 0.1) -> None:
        self.forgetting = forgetting
        self.ridge = ridge
        # A knot's slope change is pulled to 0 unless about one sample a batch away supports it.
        self.knot_ridge = knot_ridge
        # The per-prefill-token cost likewise, unless steps with hundreds of prefill tokens support
        # it: a pod that has only seen short (or cached) prompts has no idea of it, and a free
        # coefficient there would take up the noise of its few prefill steps and price a burst's
        # queue in seconds (TTFT is predicted from this model).
        self.prefill_ridge = prefill_ridge
        self.min_samples = min_samples
        self.num_samples = 0
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._coef: list[float] | None = None
        self._dirty = False
        self._outliers = 0          # outliers in a row, dropped so far

    def add(self, num_seqs: int, num_context_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        # Against the last solved fit (no solve per sample: pods report hundreds a second).
        predicted = _evaluate(self._coef, num_seqs, num_context_tokens, num_prefill_tokens) \
            if self._coef is not None and self.fitted else None
        if predicted and seconds > self.OUTLIER_FACTOR * predicted:
            self._outliers += 1
            if self._outliers < self.OUTLIER_RUN:
                return
        self._outliers = 0
        x = _features(num_seqs, num_context_tokens, num_prefill_tokens)
        lam = self.forgetting
        for i in range(NUM_FEATURES):
            xi = x[i]
            self._xty[i] = lam * self._xty[i] + xi * seconds
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = lam * row[j] + xi * x[j]
        self.num_samples += 1
        self._dirty = True

    @property
    def fitted(self) -> bool:
        return self.num_samples >= self.min_samples

    def coefficients(self) -> list[float] | None:
        if self._dirty:
            matrix = [row[:] for row in self._xtx]
            for i in range(NUM_FEATURES):
                matrix[i][i] += self.knot_ridge if i in _HINGES else self.ridge
            matrix[NUM_FEATURES - 1][NUM_FEATURES - 1] += self.prefill_ridge - self.ridge
            self._coef = _solve(matrix, self._xty)
            self._dirty = False
        return self._coef

    def predict(self, num_seqs: int, num_context_tokens: int, num_prefill_tokens: int = 0) -> float | None:
        """Predicted step seconds, or None until `min_samples` samples have been seen.

        The batch-size part is integrated segment by segment with negative slopes read as 0: a
        step never gets cheaper by adding sequences, so noise near a sparsely sampled knot cannot
        make a busier pod look faster.
        """
        coef = self.coefficients() if self.fitted else None
        return None if coef is None else _evaluate(coef, num_seqs, num_context_tokens, num_prefill_tokens)


def _evaluate(coef: list[float], num_seqs: int, num_context_tokens: int, num_prefill_tokens: int) -> float:
    """The fitted step time; slopes below zero count as zero (see `StepTimeModel.predict`)."""
    seconds = (coef[0] + coef[-2] * num_context_tokens * _CONTEXT_SCALE
               + coef[-1] * num_prefill_tokens * _PREFILL_SCALE)
    slope, start = coef[1], 0.0
    for i, knot in enumerate((*SEQ_KNOTS, float("inf"))):
        end = min(float(num_seqs), knot)
        if end > start:
            seconds += max(0.0, slope) * (end - start)
        if num_seqs <= knot:
            break
        slope += coef[2 + i]
        start = knot
    return max(0.0, seconds)


class RecentQuantile:
    """The `quantile` of the last `window` values observed, or None before `min_samples`."""

    def __init__(self, quantile: float = 0.95, window: int = 200, min_samples: int = 20) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self._values: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    @property
    def num_samples(self) -> int:
        return len(self._values)

    def observe(self, value: float) -> None:
        self._values.append(value)
        if len(self._values) >= self.min_samples:
            # Once per finished request, over at most `window` floats: cheap next to routing.
            ordered = sorted(self._values)
            self.value = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]


class LatencyCalibration:
    """A quantile (by default the median) of observed / predicted latency (TPOT or TTFT) on one pod,
    over its recent requests.

    `factor` is what the model's prediction is multiplied by to estimate the latency a client sees
    at that quantile: 1 until `min_samples` requests have finished, then the `quantile` of the last
    `window` ratios, clamped to [`min_factor`, `max_factor`] so one odd stretch (a pod paused by a
    neighbour) cannot shut a pod out or let it be flooded.
    """

    def __init__(self, quantile: float = 0.5, window: int = 200, min_samples: int = 20,
                 min_factor: float = 0.8, max_factor: float = 3.0) -> None:
        self.min_samples = min_samples
        self.min_factor = min_factor
        self.max_factor = max_factor
        self._ratios = RecentQuantile(quantile, window, min_samples)
        self.factor = 1.0

    @property
    def num_samples(self) -> int:
        return self._ratios.num_samples

    def observe(self, observed: float, predicted: float) -> None:
        """One request: its measured latency and the (uncalibrated) one predicted when it was routed."""
        if predicted <= 0.0:
            return
        self._ratios.observe(observed / predicted)
        if self._ratios.value is not None:
            self.factor = min(self.max_factor, max(self.min_factor, self._ratios.value))


def ttft_calibration() -> LatencyCalibration:
    """TTFT, at the 90th percentile: the queue model is often pessimistic (a running prompt counts
    whole although partly done) or optimistic (overheads outside the prefill rate), so the factor
    may also shrink it. With prefill pods counting only their own prefills, 1P1D at 6-10 req/s
    served 5.74 / 6.87 / 7.22 req/s with TTFT at the 90th percentile against 5.42 / 5.80 / 5.54 at
    the median (TPOT at the 90th in both; session 16, `docs/benchmarks.md`, "The prefill pod's in-flight count")."""
    return LatencyCalibration(quantile=0.9, min_factor=0.5)


def tpot_calibration() -> LatencyCalibration:
    """TPOT, at the 80th percentile: the gate admits until the calibrated prediction reaches the
    SLO, so the quantile is the share of a full pod's requests that meet it. At the median, past
    the knee half of what a lone colocated pod admitted missed its TPOT (session 17: 75-251 of
    420-480 requests; goodput 1.2-6.5 req/s where it finished 11), and which half swung with the
    machine's noise."""
    return LatencyCalibration(quantile=0.8)


def predict_ttft(queued_prefill_tokens: int, uncached_tokens: int, prefill_tokens_per_second: float,
                 calibration: float = 1.0) -> float:
    """Seconds until the first token at a measured rate: the queue ahead, then this prompt's
    uncached tokens; times `calibration` (a `LatencyCalibration.factor`), the quantile clients see.
    The fallback of `predict_ttft_in_steps` until a pod's step model is fitted."""
    return calibration * (max(0, queued_prefill_tokens) + max(0, uncached_tokens)) / prefill_tokens_per_second


def predict_ttft_in_steps(model: StepTimeModel, work_tokens: int, max_num_batched_tokens: int, num_seqs: int,
                          num_context_tokens: int = 0, fallback_step_seconds: float = 0.0) -> float | None:
    """Seconds the pod needs for `work_tokens` prefill tokens (the queue ahead plus this prompt's
    uncached ones), in steps of at most `max_num_batched_tokens` (0: unknown, one step).

    `num_seqs` sequences share the work (spread over the steps), and each step also runs the
    pod's `num_context_tokens` of decode context (a colocated or decode pod prefilling locally).
    Until `model` is fitted each step costs `fallback_step_seconds` (the pod's reported step-time
    EWMA: a prefill pod steps only when it has work, and batches a burst into a few steps, so its
    model fills slowly) when the budget is known; None otherwise (the caller falls back to a rate).
    """
    work = max(1, work_tokens)
    budget = max_num_batched_tokens if max_num_batched_tokens > 0 else work
    full_steps, rest = divmod(work, budget)
    num_steps = full_steps + (1 if rest else 0)
    if not model.fitted:
        if fallback_step_seconds > 0 and max_num_batched_tokens > 0:
            return num_steps * fallback_step_seconds
        return None
    seqs_per_step = max(1, -(-num_seqs // num_steps))
    seconds = 0.0
    for tokens, count in ((budget, full_steps), (rest, 1 if rest else 0)):
        if count:
            step = model.predict(seqs_per_step, num_context_tokens + tokens, tokens)
            seconds += count * (step or 0.0)
    return seconds


def client_tpot(step_seconds: float, pd_gap_seconds: float, max_tokens: int) -> float:
    """The TPOT a client sees (OpenAI's: the mean gap after the first token) for `max_tokens`
    tokens: the first gap is the P→D hand-over (the KV pull and D's first step), the other
    `max_tokens - 2` are decode steps. Short answers are mostly hand-over; long ones, steps."""
    if max_tokens <= 2:
        return pd_gap_seconds if max_tokens == 2 else step_seconds
    return (pd_gap_seconds + (max_tokens - 2) * step_seconds) / (max_tokens - 1)


def predict_tpot(model: StepTimeModel, num_seqs: int, num_context_tokens: int,
                 fallback_step_seconds: float, calibration: float = 1.0) -> float:
    """Seconds per output token with the batch at (`num_seqs`, `num_context_tokens`).

    `calibration` (a `LatencyCalibration.factor`) turns the model's mean step time into the TPOT
    quantile clients see. Before the model has enough samples, the pod's reported step-time EWMA
    stands in: it ignores the extra request, which errs towards admitting while the pod is still cold.
    """
    predicted = model.predict(num_seqs, num_context_tokens)
    return (fallback_step_seconds if predicted is None else predicted) * calibration
