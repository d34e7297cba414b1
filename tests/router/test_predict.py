"""Latency predictors: the TTFT formula, the online step-time model and the TPOT calibration."""

from __future__ import annotations

import random

import pytest

from router.predict import (LatencyCalibration, StepTimeModel, client_tpot, predict_tpot, predict_ttft,
                            predict_ttft_in_steps,
                            tpot_calibration, ttft_calibration)


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


# Step-time shapes that are not linear in the batch size (CPU decode is convex in it; a GPU is flat
# while memory-bound, then steep). Context adds 0.1 µs per token on top.
CONVEX_SHAPES = [
    ("quadratic", lambda n: 0.003 + 0.0003 * n + 0.00002 * n * n),
    ("flat then steep", lambda n: 0.008 + 0.0001 * n + 0.001 * max(0, n - 24)),
    ("cubic", lambda n: 0.002 + 0.0001 * n + 1e-7 * n ** 3),
]
LARGE_BATCHES = (40, 48, 56, 64)


def _fit_convex(step, knot_ridge: float = 1.0) -> StepTimeModel:
    rng = random.Random(0)
    model = StepTimeModel(knot_ridge=knot_ridge)
    for _ in range(400):
        seqs = rng.randint(1, 64)
        ctx = seqs * rng.randint(100, 400)
        model.add(seqs, ctx, 0, (step(seqs) + 1e-7 * ctx) * (1 + rng.uniform(-0.03, 0.03)))
    return model


def _worst_error(model: StepTimeModel, step) -> float:
    return max(abs(model.predict(n, 250 * n) / (step(n) + 1e-7 * 250 * n) - 1) for n in LARGE_BATCHES)


@pytest.mark.parametrize("name,step", CONVEX_SHAPES, ids=[c[0] for c in CONVEX_SHAPES])
def test_step_model_follows_a_convex_step_time_at_large_batches(name, step):
    error = _worst_error(_fit_convex(step), step)
    assert error < 0.10
    # A huge knot ridge pins every slope change to 0: the plain linear fit, which is visibly worse.
    assert _worst_error(_fit_convex(step, knot_ridge=1e12), step) > error


# (name, samples (num_seqs, context, seconds)) — too few, or too narrow, to pin the model down.
FEW_SAMPLE_CASES = [
    ("eight samples at one batch size", [(4, 400 + i, 0.010 + 0.0001 * (i % 3)) for i in range(8)]),
    ("eight noisy samples, small batches", [(1 + i % 3, 100 * (1 + i % 3), 0.005 + 0.001 * (i % 2)) for i in range(8)]),
    ("a few samples above a knot", [(n, 100 * n, 0.002 + 0.0002 * n) for n in range(1, 30)]
     + [(65, 6500, 0.030), (66, 6600, 0.012)]),
]


@pytest.mark.parametrize("name,samples", FEW_SAMPLE_CASES, ids=[c[0] for c in FEW_SAMPLE_CASES])
def test_step_model_stays_sane_with_few_samples(name, samples):
    model = StepTimeModel()
    for seqs, ctx, seconds in samples:
        model.add(seqs, ctx, 0, seconds)
    seen = [seconds for _, _, seconds in samples]
    predictions = [model.predict(n, 100 * n) for n in range(1, 130)]
    assert all(p is not None and p >= 0.0 for p in predictions)
    assert predictions == sorted(predictions)            # never cheaper with more sequences
    for seqs, ctx, _ in samples:                          # near what was seen where it was seen
        assert min(seen) / 2 <= model.predict(seqs, ctx) <= 2 * max(seen)


# (name, observed / predicted ratios fed in order, expected factor)
CALIBRATION_CASES = [
    ("no requests yet: 1", [], 1.0),
    ("fewer than min_samples: still 1", [2.0] * 19, 1.0),
    ("a constant ratio is learnt", [1.3] * 50, 1.3),
    ("the median of a spread", [1.0 + i / 100 for i in range(100)], 1.5),
    ("clamped above", [10.0] * 30, 3.0),
    ("clamped below", [0.2] * 30, 0.8),
    ("old requests leave the window", [2.5] * 200 + [1.2] * 200, 1.2),
]


@pytest.mark.parametrize("name,ratios,expected", CALIBRATION_CASES, ids=[c[0] for c in CALIBRATION_CASES])
def test_a_calibration_is_a_clamped_median_by_default(name, ratios, expected):
    calibration = LatencyCalibration()
    for ratio in ratios:
        calibration.observe(0.02 * ratio, 0.02)
    assert calibration.factor == pytest.approx(expected, abs=0.011)


@pytest.mark.parametrize("make,quantile", [(tpot_calibration, 0.8), (ttft_calibration, 0.9)])
def test_the_routers_calibrations_are_high_quantiles(make, quantile):
    # What a pod's clients see at a high quantile, not the median: the goodput gate admits up to
    # where the calibrated prediction meets the SLO, so at the median half of those admitted there
    # would miss it (session 17, docs/benchmarks.md: "Admission past the knee").
    calibration = make()
    for i in range(100):
        calibration.observe(0.02 * (1.0 + i / 100), 0.02)
    assert calibration.factor == pytest.approx(1.0 + quantile, abs=0.011)


def test_tpot_calibration_converges_on_noisy_requests():
    # Observed TPOT = 1.5 x predicted x U(0.8, 1.2): the median ratio is 1.5.
    rng = random.Random(0)
    calibration = LatencyCalibration()
    for _ in range(1000):
        predicted = rng.uniform(0.005, 0.04)
        calibration.observe(predicted * 1.5 * rng.uniform(0.8, 1.2), predicted)
    assert calibration.factor == pytest.approx(1.5, rel=0.04)


def test_tpot_is_scaled_by_the_calibration():
    model = StepTimeModel(min_samples=8)
    assert predict_tpot(model, 4, 100, fallback_step_seconds=0.02, calibration=1.5) == pytest.approx(0.03)
    for i in range(8):
        model.add(i + 1, 100, 0, 0.001 * (i + 1))
    assert predict_tpot(model, 4, 100, 0.02, calibration=2.0) == pytest.approx(0.008, abs=1e-3)


def test_ttft_calibration_may_shrink_a_pessimistic_queue_model():
    calibration = ttft_calibration()
    for _ in range(50):
        calibration.observe(0.3, 0.5)          # clients saw 0.6x the prediction
    assert calibration.factor == pytest.approx(0.6)
    for _ in range(200):
        calibration.observe(0.1, 0.5)          # 0.2x: clamped, one odd stretch cannot open the gates
    assert calibration.factor == pytest.approx(0.5)
    assert predict_ttft(400, 100, 1000.0, calibration.factor) == pytest.approx(0.25)


def test_one_paused_step_does_not_move_the_model_but_a_lasting_slowdown_does():
    model = StepTimeModel()
    for i in range(64):
        model.add(1 + i % 8, 100, 0, 0.010)
    before = model.predict(4, 100)
    model.add(4, 100, 0, 10.0)                  # SIGSTOP mid-step: a 10 s "step"
    assert model.predict(4, 100) == pytest.approx(before, rel=0.01)
    for _ in range(StepTimeModel.OUTLIER_RUN):  # the pod really is 10x slower now
        model.add(4, 100, 0, 0.2)
    assert model.predict(4, 100) > 2 * before


def test_ttft_in_steps_prices_the_steps_a_queue_takes():
    model = StepTimeModel()
    for i in range(64):
        seqs, prefill = 1 + i % 8, 512 * (i % 2)
        model.add(seqs, prefill, prefill, 0.010 + 0.001 * seqs + 2e-5 * prefill)
    one_step = predict_ttft_in_steps(model, 16, 512, num_seqs=16)
    assert one_step == pytest.approx(0.010 + 0.016 + 2e-5 * 16, rel=0.15)   # sixteen short prompts: one step
    four_steps = predict_ttft_in_steps(model, 4 * 512, 512, num_seqs=4)
    assert four_steps == pytest.approx(4 * (0.010 + 0.001 + 2e-5 * 512), rel=0.1)
    # Before the model has samples: the pod's step EWMA per step, if the budget is known.
    assert predict_ttft_in_steps(StepTimeModel(), 1025, 512, 1, fallback_step_seconds=0.05) == pytest.approx(0.15)
    assert predict_ttft_in_steps(StepTimeModel(), 1025, 0, 1, fallback_step_seconds=0.05) is None


@pytest.mark.parametrize("max_tokens,expected", [(1, 0.01), (2, 0.06), (8, (0.06 + 6 * 0.01) / 7),
                                                 (200, (0.06 + 198 * 0.01) / 199)])
def test_client_tpot_spreads_the_hand_over_over_the_answer(max_tokens, expected):
    assert client_tpot(0.01, 0.06, max_tokens) == pytest.approx(expected)


def test_the_hand_over_is_measured_apart_and_spread_over_the_answer():
    from policy_pods import pod
    from router.dispatch import Dispatcher
    from router.metrics import RouterMetrics
    from router.policy import RoutingDecision

    decode = pod("d", "decode")
    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.metrics = RouterMetrics()
    decision = RoutingDecision(pod("p"), decode, predicted_tpot_seconds=0.01)
    for _ in range(decode.tpot_calibration.min_samples):
        # 8 tokens: a 60 ms hand-over, then 6 steps of 15 ms (1.5x the model's 10 ms).
        dispatcher.observe_tpot(decision, 0.06 + 6 * 0.015, 8, pd_gap_seconds=0.06)
    assert decode.pd_gap.value == pytest.approx(0.06)
    # Observed (0.06 + 0.09) / 7 against predicted (0.06 + 0.06) / 7: 1.25, not 0.15 / 7 / 0.01 = 2.1.
    assert decode.tpot_calibration.factor == pytest.approx(1.25)
