"""Structured outputs under tensor parallelism (Gloo on CPU): TP=2 gives TP=1's tokens.

Grammar state lives on rank 0, which samples; the other rank never sees a grammar (it runs the
same forward passes whatever the masks are). One real rank subprocess.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from tests.engine.structured_cases import SMALL_SPECS, check_complete

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("CBSERVE_NUM_THREADS", "1")   # the rank subprocess reads it


def _run(tp: int, prompts, params):
    engine = Engine(EngineConfig(model="tiny", tensor_parallel_size=tp, cache=CacheConfig(num_blocks=128),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    try:
        return [(o.output_token_ids, o.finish_reason, o.text) for o in engine.generate(prompts, params)]
    finally:
        engine.close()


def test_tp2_equals_tp1_under_grammars():
    prompts, params = [], []
    for k, spec in enumerate(SMALL_SPECS.values()):
        for sp in (SamplingParams(temperature=0.0, max_tokens=40, structured=spec),
                   SamplingParams(temperature=1.0, seed=k, max_tokens=40, structured=spec)):
            prompts.append([1] + [(7 * k + 3 * len(prompts) + i) % 250 + 4 for i in range(9 + 30 * k)])
            params.append(sp)
    prompts.append([1, 40, 41, 42])
    params.append(SamplingParams(temperature=0.0, max_tokens=6))
    want = _run(1, prompts, params)
    assert _run(2, prompts, params) == want
    for (_, reason, text), sp in zip(want, params):
        if sp.structured is not None and reason == "stop":
            check_complete(sp.structured, text)
