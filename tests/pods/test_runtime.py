"""`PodRuntime` in this process (no server): what pods ask of their engine and how often they
snapshot it."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import EngineConfig
from engine.sampling.params import SamplingParams
from pod import runtime as runtime_mod
from pod.runtime import PodConfig, PodRuntime


@pytest.fixture(scope="module")
def rt() -> PodRuntime:
    config = EngineConfig(model="tiny", role="decode", cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    return PodRuntime(config, PodConfig(), "decode")


def _count(rt: PodRuntime, name: str) -> float:
    return rt.metrics.registry.get_sample_value(f"{name}_count", {"role": rt.role_label}) or 0.0


def test_pod_engines_detokenize_only_requests_with_stop_strings(rt):
    engine = rt.engine
    assert engine.config.detokenize is False
    engine.add_request([1, 5, 9], SamplingParams(max_tokens=4), request_id="plain")
    engine.add_request([1, 5, 9], SamplingParams(max_tokens=4, stop=["zz"]), request_id="stops")
    try:
        assert set(engine._detok) == {"stops"}
    finally:
        engine.abort("plain"), engine.abort("stops")


def test_snapshot_refreshes_on_a_timer_or_when_held_kv_changes(rt, monkeypatch):
    monkeypatch.setattr(runtime_mod, "REFRESH_SECONDS", 3600.0)
    engine = rt.engine
    rt.refresh(engine)
    before = rt.snapshot
    engine.add_request([1, 5, 9], SamplingParams(max_tokens=4), request_id="queued")
    try:
        rt.after_step(engine)
        assert rt.snapshot is before                    # not due: no stats() walk this step
        rt.after_step(engine, num_held=1)
        assert rt.snapshot is not before and rt.snapshot.num_waiting == 1 and rt.num_held == 1
        engine.add_request([1, 5, 9], SamplingParams(max_tokens=4), request_id="more")
        monkeypatch.setattr(runtime_mod, "REFRESH_SECONDS", 0.0)
        rt.after_step(engine, num_held=1)
        assert rt.snapshot.num_waiting == 2             # due: refreshed
        monkeypatch.setattr(runtime_mod, "REFRESH_SECONDS", 3600.0)
        engine.abort("queued"), engine.abort("more")
        rt.after_step(engine, num_held=1)
        assert rt.snapshot.num_waiting == 0             # idle now: a finished stream's report shows it
    finally:
        engine.abort("more")
        engine.abort("queued")
        rt.refresh(engine)


def test_every_step_is_timed_once(rt):
    engine = rt.engine
    count = _count(rt, "cbserve_step_seconds")
    engine.add_request([1, 5, 9], SamplingParams(max_tokens=5, ignore_eos=True), request_id="timed")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        rt.after_step(engine)
    rt.after_step(engine)                               # a hook call without a new step
    assert steps == 5 and _count(rt, "cbserve_step_seconds") - count == 5
    assert rt.metrics.registry.get_sample_value("cbserve_step_seconds_sum", {"role": "decode"}) > 0
