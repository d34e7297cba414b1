"""Latency predictors: the TTFT formula and the online step-time model."""

from __future__ import annotations

import random

import pytest

from router.predict import StepTimeModel, predict_tpot, predict_ttft


def test_ttft_is_queue_plus_uncached_over_rate():
    assert predict_ttft(queued_prefill_tokens=3000, uncached_tokens=1000, prefill_tokens_per_second=8000) == 0.5
    assert predict_ttft(0, 0, 1000) == 0.0


def test_step_model_recovers_a_linear_cost_from_noisy_samples():
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(300):
        seqs, ctx, pre = rng.randint(1, 64), rng.randint(100, 20000), rng.choice([0, 0, 256])
        seconds = 0.004 + 0.0002 * seqs + 1e-6 * ctx + 2e-5 * pre
        model.add(seqs, ctx, pre, seconds * (1 + rng.uniform(-0.01, 0.01)))
    assert model.predict(32, 10000) == pytest.approx(0.004 + 0.0064 + 0.01, rel=0.03)
    assert model.predict(1, 100, 256) == pytest.approx(0.004 + 0.0002 + 0.0001 + 0.00512, rel=0.05)


def test_step_model_forgets_old_behaviour():
    model = StepTimeModel(forgetting=0.95)
    for seqs in range(1, 200):
        model.add(seqs % 16 + 1, 1000, 0, 0.010)
    for seqs in range(1, 200):
        model.add(seqs % 16 + 1, 1000, 0, 0.030)   # the pod got slower (e.g. a noisy neighbour)
    assert model.predict(8, 1000) == pytest.approx(0.030, rel=0.05)


def test_tpot_falls_back_to_reported_ewma_until_fitted():
    model = StepTimeModel(min_samples=8)
    assert predict_tpot(model, 4, 100, fallback_step_seconds=0.02) == 0.02
    for i in range(8):
        model.add(i + 1, 100, 0, 0.001 * (i + 1))
    assert predict_tpot(model, 4, 100, fallback_step_seconds=0.02) == pytest.approx(0.004, abs=5e-4)
