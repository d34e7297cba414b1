"""The step cost model: seconds of one engine step from its `StepShape`, linear in a few features.

    seconds = c0 + c_tok·tokens + Σ_k c_k·max(0, tokens - k) + c_seq·seqs + c_smp·sampled
              + c_dctx·decode_context + c_dpad·decode_padded + c_dmask·decode_masked
              + c_pattn·prefill_attention

- tokens (every token computed) carry the matmuls; the hinges at `TOKEN_KNOTS` give each range of
  step sizes its own slope (a few rows are memory-bound weight reads, many rows compute-bound);
- seqs and sampled carry the per-sequence host work and the lm_head/sampler rows;
- decode_context (Σ context over decodes) carries decode attention, which reads each sequence's KV,
  and decode_padded (decodes x the longest context) the same where rows are padded to the longest
  (the CPU path), decode_masked (the same, when contexts differ) the masked kernel that then runs
  (the CPU path again; a serving batch nearly always has unequal contexts); the fit keeps
  whichever terms the device shows;
- prefill_attention (Σ over chunks of n·(start + (n + 1)/2), the query-key pairs) carries prefill
  attention, quadratic in a prompt's length (DistServe's and Vidur's term).
Fitted by weighted least squares with weights 1/seconds, i.e. on relative error, which is what the
planner's percentiles feel; a coefficient that comes out negative is dropped and the rest refitted
(a step never gets cheaper with more work). The router's online `StepTimeModel` (router/predict.py)
keeps its own, smaller feature set: it fits what pods report, not what a profile measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.telemetry.step_shape import StepShape

TOKEN_KNOTS = (32, 256)
FEATURES = ("intercept", "tokens", *(f"tokens>{k}" for k in TOKEN_KNOTS), "seqs", "sampled",
            "decode_context", "decode_padded", "decode_masked", "prefill_attention")
# Scales bring the features to comparable magnitudes (the fit's conditioning, the stored numbers).
_SCALES = (1.0, 1e-3, *(1e-3 for _ in TOKEN_KNOTS), 1e-2, 1e-2, 1e-5, 1e-5, 1e-5, 1e-6)


def features(shape: StepShape) -> list[float]:
    tokens = shape.num_decodes
    attention = 0.0
    for n, start in shape.prefill_chunks:
        tokens += n
        attention += n * (start + (n + 1) / 2)
    padded = shape.num_decodes * shape.max_decode_context
    raw = (1.0, tokens, *(max(0, tokens - k) for k in TOKEN_KNOTS), shape.num_decodes + len(shape.prefill_chunks),
           shape.num_sampled, shape.decode_context_tokens, padded,
           padded if shape.min_decode_context != shape.max_decode_context else 0, attention)
    return [x * s for x, s in zip(raw, _SCALES)]


@dataclass(frozen=True)
class StepCostModel:
    """Fitted coefficients, one per name in `FEATURES` (scaled features)."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a step cost model has {len(FEATURES)} coefficients, got {len(self.coefficients)}")

    def seconds(self, shape: StepShape) -> float:
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, features(shape))))

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepCostModel:
        """Least squares on relative error; negative coefficients dropped and refitted."""
        import numpy as np

        if len(shapes) != len(seconds) or not shapes:
            raise ValueError("fit needs as many step times as shapes, and at least one")
        x = np.array([features(s) for s in shapes])
        y = np.array(seconds, dtype=float)
        if (y <= 0).any():
            raise ValueError("step times must be > 0")
        weights = 1.0 / y
        active = list(range(len(FEATURES)))
        while True:
            a = x[:, active] * weights[:, None]
            coef, *_ = np.linalg.lstsq(a, y * weights, rcond=None)
            negative = [active[i] for i, c in enumerate(coef) if c < 0 and active[i] != 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: coef[active.index(i)]))
        full = [0.0] * len(FEATURES)
        for i, c in zip(active, coef):
            full[i] = float(c)
        return cls(tuple(full))

    def to_json(self) -> dict:
        return {"features": list(FEATURES), "coefficients": list(self.coefficients)}

    @classmethod
    def from_json(cls, value: dict) -> StepCostModel:
        if list(value.get("features", ())) != list(FEATURES):
            raise ValueError(f"the profile's cost model has features {value.get('features')}, this cbserve "
                             f"expects {list(FEATURES)}: re-run `cbserve profile`")
        return cls(tuple(float(c) for c in value["coefficients"]))


def relative_errors(model: StepCostModel, shapes: Sequence[StepShape], seconds: Sequence[float]) -> list[float]:
    """|predicted - measured| / measured per step."""
    return [abs(model.seconds(s) - t) / t for s, t in zip(shapes, seconds)]
