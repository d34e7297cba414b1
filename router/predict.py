"""Latency predictors: TTFT on a prefill pod, TPOT on a decode pod, from the pods' own reports.

TTFT: the prompt waits behind the pod's queued prefill tokens, then its own uncached tokens are
computed, both at the pod's measured prefill rate (tokens/s):
    ttft = (queued_prefill_tokens + uncached_tokens) / prefill_tokens_per_second
TPOT: one decode step runs every sequence of the batch, so the time per output token is the step
time at the batch the pod will have with this request added. The step time is fitted online from
the (num_seqs, num_context_tokens, num_prefill_tokens, seconds) samples each pod reports:
    seconds ≈ a + b * num_seqs + c * num_context_tokens + d * num_prefill_tokens
by least squares over exponentially forgotten normal equations (old batches fade as the pod's
behaviour drifts), with a small ridge term so a few collinear samples still give an answer.
"""

from __future__ import annotations

NUM_FEATURES = 4
# Features are scaled to comparable magnitudes so the ridge term treats them alike.
_CONTEXT_SCALE = 1e-3
_PREFILL_SCALE = 1e-3


def _features(num_seqs: float, num_context_tokens: float, num_prefill_tokens: float) -> list[float]:
    return [1.0, float(num_seqs), num_context_tokens * _CONTEXT_SCALE, num_prefill_tokens * _PREFILL_SCALE]


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
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


class StepTimeModel:
    """Online linear model of a pod's step time; `predict` returns seconds per step."""

    def __init__(self, forgetting: float = 0.995, ridge: float = 1e-6, min_samples: int = 8) -> None:
        self.forgetting = forgetting
        self.ridge = ridge
        self.min_samples = min_samples
        self.num_samples = 0
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._coef: list[float] | None = None
        self._dirty = False
        self.max_seconds = 0.0

    def add(self, num_seqs: int, num_context_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        x = _features(num_seqs, num_context_tokens, num_prefill_tokens)
        lam = self.forgetting
        for i in range(NUM_FEATURES):
            self._xty[i] = lam * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = lam * row[j] + x[i] * x[j]
        self.num_samples += 1
        self.max_seconds = max(self.max_seconds * lam, seconds)
        self._dirty = True

    @property
    def fitted(self) -> bool:
        return self.num_samples >= self.min_samples

    def coefficients(self) -> list[float] | None:
        if self._dirty:
            matrix = [row[:] for row in self._xtx]
            for i in range(NUM_FEATURES):
                matrix[i][i] += self.ridge
            self._coef = _solve(matrix, self._xty)
            self._dirty = False
        return self._coef

    def predict(self, num_seqs: int, num_context_tokens: int, num_prefill_tokens: int = 0) -> float | None:
        """Predicted step seconds, or None until `min_samples` samples have been seen."""
        coef = self.coefficients() if self.fitted else None
        if coef is None:
            return None
        x = _features(num_seqs, num_context_tokens, num_prefill_tokens)
        return max(0.0, sum(c * v for c, v in zip(coef, x)))


def predict_ttft(queued_prefill_tokens: int, uncached_tokens: int, prefill_tokens_per_second: float) -> float:
    """Seconds until the first token: the queue ahead, then this prompt's uncached tokens."""
    return (max(0, queued_prefill_tokens) + max(0, uncached_tokens)) / prefill_tokens_per_second


def predict_tpot(model: StepTimeModel, num_seqs: int, num_context_tokens: int,
                 fallback_step_seconds: float) -> float:
    """Seconds per output token with the batch at (`num_seqs`, `num_context_tokens`).

    Before the model has enough samples, the pod's reported step-time EWMA stands in: it ignores
    the extra request, which errs towards admitting while the pod is still cold.
    """
    predicted = model.predict(num_seqs, num_context_tokens)
    return fallback_step_seconds if predicted is None else predicted
