"""The seams the planner runs production code through: injected clocks (scheduler, PodState,
admission, dispatcher), the dispatcher's wiring and the pods' load report, one function for both."""

from __future__ import annotations

import asyncio

import pytest

from cbserve.planner.virtual_loop import run_virtual
from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineStats, StepSample
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from pod.load_report import build_load_report
from router.config import RouterConfig
from router.discovery.base import PodEndpoint
from router.dispatch import SequenceSpec, SequenceTrace, build_dispatcher
from router.errors import APIError
from router.load import LOAD_SILENCE_SECONDS, PodState
from router.metrics import RouterMetrics
from router.policy import RoutingRequest


def test_scheduler_times_come_from_the_clock():
    now = [7.0]
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(num_blocks=16), clock=lambda: now[0])
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
    scheduler.add_request(request)
    out = scheduler.schedule()
    now[0] = 8.0
    scheduler.update(out, {"a": 5})
    now[0] = 9.0
    out = scheduler.schedule()
    scheduler.update(out, {"a": 6})
    assert (request.first_scheduled_time, request.first_token_time, request.finished_time) == (7.0, 8.0, 9.0)


def test_pod_state_reads_its_clock():
    now = [0.0]
    pod = PodState(PodEndpoint("p", "decode"), client=None, healthy=True, clock=lambda: now[0])
    pod.report_time = 0.0
    now[0] = LOAD_SILENCE_SECONDS - 0.1
    assert not pod.silent
    now[0] = LOAD_SILENCE_SECONDS + 0.1
    assert pod.silent
    pod.on_dispatch(100)
    assert list(pod.unreported) == [(LOAD_SILENCE_SECONDS + 0.1, 100, 100)]


def test_admission_waits_on_the_virtual_clock_and_the_dispatcher_is_wired_as_the_app_wires_it():
    async def main():
        loop = asyncio.get_running_loop()
        config = RouterConfig(policy="goodput", slo_ttft_ms=100, slo_tpot_ms=10, max_queue_seconds=4.0)
        dispatcher = build_dispatcher(config, RouterMetrics(), clock=loop.time)
        assert dispatcher.admission.wake in dispatcher.tracker._listeners
        dispatcher.tracker.pods["d"] = PodState(PodEndpoint("d", "colocated"), client=None, healthy=True,
                                                clock=loop.time)
        busy = dispatcher.tracker.pods["d"]
        busy.num_inflight = 50               # not idle: the SLO filter may refuse it
        busy.step_model.max_seconds = 1.0
        for _ in range(10):
            busy.step_model.add(50, 5000, 0, 1.0)
        routing = RoutingRequest("r", 10, 8, 10.0, 0.01)
        spec = SequenceSpec("r", [1] * 10, SamplingParams(max_tokens=8), routing, 0.0, loop.time() + 60)
        with pytest.raises(APIError) as refused:
            await dispatcher.admit(spec, SequenceTrace())
        return refused.value.status, loop.time()
    status, waited = run_virtual(main())
    assert status == 429 and waited == pytest.approx(4.0)      # max_queue_seconds, in virtual time


def test_load_report_carries_the_snapshot_and_the_newest_samples():
    stats = EngineStats(num_running=3, num_waiting=2, prefill_queue_tokens=900, num_free_blocks=10,
                        num_total_blocks=40, kv_cache_usage=0.75, prefix_cache_hit_ratio=0.0, num_preemptions=1,
                        step_seconds_ewma=0.02, prefill_tokens_per_second=5000.0, num_steps=40)
    samples = [StepSample(i, 100 * i, 0, 0.01 * i) for i in range(40)]
    report = build_load_report("p0", "decode", stats, samples, draining=False, block_size=16, max_num_seqs=64,
                               max_num_batched_tokens=512, num_held_kv=0, timestamp=12.5)
    assert (report.num_running, report.num_waiting, report.prefill_queue_tokens, report.num_free_blocks) == (3, 2, 900, 10)
    assert report.max_num_batched_tokens == 512
    assert report.timestamp == 12.5 and [s.num_seqs for s in report.step_samples] == list(range(8, 40))
