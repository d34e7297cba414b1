"""The step cost model: shapes from real scheduler outputs, an exact fit on exact data, no negative
terms, a stored form that refuses another feature set."""

from __future__ import annotations

import random

import pytest

from cbserve.planner.cost_model import FEATURES, StepCostModel, relative_errors
from engine.scheduling.output import ScheduledSeq, SchedulerOutput
from engine.telemetry.step_shape import StepShape


def test_shape_of_a_scheduler_output():
    out = SchedulerOutput((ScheduledSeq("a", (5,), 99, (1,), True), ScheduledSeq("b", (6,), 9, (2,), True),
                           ScheduledSeq("c", tuple(range(30)), 16, (3, 4), False)), 32)
    shape = StepShape.of(out)
    assert shape == StepShape(2, 110, 100, 10, ((30, 16),), 2)
    assert (shape.num_seqs, shape.num_tokens, shape.num_prefill_tokens) == (3, 32, 30)
    assert StepShape.from_json(shape.to_json()) == shape


def _random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        decodes = rng.randint(0, 64)
        contexts = [rng.randint(16, 2000) for _ in range(decodes)]
        chunks = tuple((rng.randint(2, 512), rng.randrange(0, 1024, 16)) for _ in range(rng.randint(0, 2)))
        if not decodes and not chunks:
            chunks = ((64, 0),)
        final_chunks = sum(rng.random() < 0.5 for _ in chunks)     # a prompt's last chunk samples
        shapes.append(StepShape(decodes, sum(contexts), max(contexts, default=0), min(contexts, default=0), chunks,
                                decodes + final_chunks))
    return shapes


def test_fit_recovers_the_coefficients_of_exact_data():
    truth = StepCostModel(tuple(0.001 * (i + 1) for i in range(len(FEATURES))))
    shapes = _random_shapes(300)
    fitted = StepCostModel.fit(shapes, [truth.seconds(s) for s in shapes])
    assert max(relative_errors(fitted, shapes, [truth.seconds(s) for s in shapes])) < 1e-6
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-4, abs=1e-9)


def test_a_term_the_data_contradicts_is_dropped_not_negative():
    # Time falls with context in this data: a negative context slope would make busier pods look
    # faster; the fit drops the term instead.
    shapes = _random_shapes(200, seed=1)
    seconds = [0.005 + 1e-4 * s.num_tokens - 1e-9 * s.decode_context_tokens for s in shapes]
    fitted = StepCostModel.fit(shapes, seconds)
    assert all(c >= 0 for c in fitted.coefficients)
    assert max(relative_errors(fitted, shapes, seconds)) < 0.05


def test_stored_form_round_trips_and_refuses_other_features():
    model = StepCostModel(tuple(float(i) for i in range(len(FEATURES))))
    assert StepCostModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError, match="re-run `cbserve profile`"):
        StepCostModel.from_json({"features": ["intercept"], "coefficients": [1.0]})
    with pytest.raises(ValueError, match="coefficients"):
        StepCostModel((1.0,))
    with pytest.raises(ValueError, match="> 0"):
        StepCostModel.fit(_random_shapes(3), [0.0, 1.0, 1.0])
