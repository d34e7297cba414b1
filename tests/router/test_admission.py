"""Admission control: 429 with Retry-After under overload, and queueing within the deadline."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from wire import cbserve_pb2 as pb
from fake_pods import Script
from router.admission import AdmissionController
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policy.base import NoRoute, RoutingDecision
from router_harness import running_router

pytestmark = pytest.mark.anyio

ROUTED = RoutingDecision(None, object())


class Capacity:
    """A scripted try_route: `free` slots; each successful route takes one. `waited` records the
    headroom waits admission passed in."""

    def __init__(self, free: int, reason: str = "slo", retry_after: float = 2.5) -> None:
        self.free, self.reason, self.retry_after = free, reason, retry_after
        self.waited: list[float] = []

    def try_route(self, headroom_waited: float = 0.0):
        self.waited.append(headroom_waited)
        if self.free > 0:
            self.free -= 1
            return ROUTED
        return NoRoute(self.reason, self.retry_after)


async def test_reject_mode_answers_429_with_retry_after():
    metrics = RouterMetrics()
    admission = AdmissionController("reject", 5.0, 10, metrics)
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0, retry_after=2.5).try_route)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "3"
    assert b'cbserve_rejected_total{reason="slo",role="router"} 1.0' in metrics.render()


async def test_no_ready_pod_is_503():
    admission = AdmissionController("reject", 5.0, 10)
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0, reason="no_pods").try_route)
    assert err.value.status == 503 and err.value.code == "no_ready_pods"


async def test_queued_request_is_admitted_when_capacity_appears():
    admission = AdmissionController("queue", 2.0, 10)
    capacity = Capacity(0)
    waiter = asyncio.create_task(admission.admit(capacity.try_route))
    await asyncio.sleep(0.1)
    assert not waiter.done() and admission.num_waiting == 1
    capacity.free = 1
    admission.wake()                      # a load report arrived
    assert await asyncio.wait_for(waiter, 1.0) is ROUTED
    assert admission.num_waiting == 0


async def test_queue_is_deadline_ordered():
    admission = AdmissionController("queue", 5.0, 10)
    capacity = Capacity(0)
    late = asyncio.create_task(admission.admit(capacity.try_route, deadline=time.monotonic() + 3.0))
    await asyncio.sleep(0.01)
    early = asyncio.create_task(admission.admit(capacity.try_route, deadline=time.monotonic() + 1.0))
    await asyncio.sleep(0.05)
    capacity.free = 1
    admission.wake()
    assert await asyncio.wait_for(early, 1.0) is ROUTED
    assert not late.done()               # arrived first, but its deadline is later
    late.cancel()


async def test_queue_wait_times_out_with_429():
    admission = AdmissionController("queue", 0.2, 10)
    start = time.monotonic()
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0).try_route)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert err.value.status == 429 and "Retry-After" in err.value.headers
    assert admission.num_waiting == 0


async def test_wait_for_slo_headroom_ends_with_the_ttft_slo():
    # Past its TTFT SLO a request can no longer count towards goodput: shed it, don't queue it on.
    admission = AdmissionController("queue", 5.0, 10)
    start = time.monotonic()
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0).try_route, slo_wait_seconds=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0 and err.value.status == 429
    assert admission.num_waiting == 0


async def test_full_queue_rejects_at_once():
    admission = AdmissionController("queue", 5.0, 1)
    capacity = Capacity(0)
    first = asyncio.create_task(admission.admit(capacity.try_route))
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as err:
        await admission.admit(capacity.try_route)
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    first.cancel()


async def test_a_request_waits_for_a_starting_pod_in_either_mode():
    for mode in ("queue", "reject"):
        admission = AdmissionController(mode, 0.1, 10, startup_wait_seconds=5.0)
        capacity = Capacity(0, reason="starting")
        waiter = asyncio.create_task(admission.admit(capacity.try_route))
        await asyncio.sleep(0.3)                 # past max_queue_seconds: a startup wait is not bound by it
        assert not waiter.done() and admission.num_waiting == 1
        capacity.free = 1
        admission.wake()                         # the pod became routable
        assert await asyncio.wait_for(waiter, 1.0) is ROUTED


async def test_the_startup_wait_ends_with_503_and_retry_after():
    metrics = RouterMetrics()
    admission = AdmissionController("queue", 5.0, 10, metrics, startup_wait_seconds=0.3)
    start = time.monotonic()
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0, reason="starting", retry_after=5.0).try_route)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert err.value.status == 503 and err.value.code == "no_ready_pods"
    assert err.value.headers["Retry-After"] == "5"
    assert b'cbserve_rejected_total{reason="startup_timeout",role="router"} 1.0' in metrics.render()
    assert admission.num_waiting == 0


async def test_the_request_deadline_bounds_a_startup_wait():
    admission = AdmissionController("queue", 5.0, 10, startup_wait_seconds=60.0)
    with pytest.raises(APIError) as err:
        await admission.admit(Capacity(0, reason="starting").try_route, deadline=time.monotonic() + 0.2)
    assert err.value.status == 503


async def test_time_waiting_for_a_pod_to_start_is_not_taken_off_the_ttft_budget():
    # The pod came up after 0.4 s, but is busy: the SLO wait (0.3 s) counts from then, and the
    # headroom waits handed to try_route start at 0.
    admission = AdmissionController("queue", 5.0, 10, startup_wait_seconds=10.0)
    capacity = Capacity(0, reason="starting")
    waiter = asyncio.create_task(admission.admit(capacity.try_route, slo_wait_seconds=0.3))
    await asyncio.sleep(0.4)
    capacity.reason = "slo"
    admission.wake()
    await asyncio.sleep(0.1)
    assert not waiter.done()                 # 0.5 s in line, 0.1 s of it for headroom
    capacity.free = 1
    admission.wake()
    assert await asyncio.wait_for(waiter, 1.0) is ROUTED
    assert capacity.waited[0] == 0.0 and 0.05 < capacity.waited[-1] < 0.3


async def test_a_waiter_whose_pods_vanished_gets_503_at_the_next_pass():
    admission = AdmissionController("queue", 5.0, 10, startup_wait_seconds=10.0)
    capacity = Capacity(0, reason="starting")
    waiter = asyncio.create_task(admission.admit(capacity.try_route))
    await asyncio.sleep(0.05)
    capacity.reason = "no_pods"               # discovery dropped them
    admission.wake()
    with pytest.raises(APIError) as err:
        await asyncio.wait_for(waiter, 1.0)
    assert err.value.status == 503


async def test_a_request_joining_a_startup_queue_waits_for_the_pods_too():
    # It cannot tell why the others wait before its first pass: it must not take the SLO's bound.
    admission = AdmissionController("queue", 0.1, 10, startup_wait_seconds=5.0)
    capacity = Capacity(0, reason="starting")
    first = asyncio.create_task(admission.admit(capacity.try_route, slo_wait_seconds=0.1))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(admission.admit(capacity.try_route, slo_wait_seconds=0.1))
    await asyncio.sleep(0.4)
    assert not first.done() and not second.done()
    capacity.free = 2
    admission.wake()
    assert await asyncio.wait_for(asyncio.gather(first, second), 1.0) == [ROUTED, ROUTED]
    assert capacity.waited == [0.0] * len(capacity.waited)   # neither waited for headroom


def _overloaded() -> pb.LoadReport:
    # 100k queued tokens at 1000 tok/s: 100 s to the first token, far past a 500 ms SLO.
    return pb.LoadReport(prefill_queue_tokens=100_000, prefill_tokens_per_second=1000)


async def test_http_overload_is_429_with_retry_after_and_no_pod_sees_it(tokenizer):
    async with running_router(tokenizer, prefill=[Script(load=_overloaded())], decode=[Script()],
                              admission="reject") as h:
        response = await h.http().post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 99
        assert response.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            await h.openai().completions.create(model="fake-model", prompt="hi", max_tokens=4, stream=True)
        assert h.num_pod_requests() == 0
        metrics = (await h.http().get("/metrics")).text
        assert 'cbserve_rejected_total{reason="slo",role="router"} 2.0' in metrics
        # A client that accepts a 200 s TTFT for this request gets served.
        ok = await h.http().post("/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                                 headers={"x-slo-ttft-ms": "200000"})
        assert ok.status_code == 200


async def test_http_request_waits_in_queue_until_the_pod_catches_up(tokenizer):
    prefill = Script(load=_overloaded())
    async with running_router(tokenizer, prefill=[prefill], decode=[Script()], admission="queue",
                              max_queue_seconds=5.0) as h:
        client = h.http()
        start = time.monotonic()
        pending = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}))
        await asyncio.sleep(0.4)
        assert not pending.done() and h.num_pod_requests() == 0
        prefill.load.prefill_queue_tokens = 0          # the backlog drains; the next report says so
        response = await asyncio.wait_for(pending, 5.0)
        assert response.status_code == 200
        assert 0.4 <= time.monotonic() - start < 5.0
        metrics = (await client.get("/metrics")).text
        assert 'cbserve_request_phase_seconds_sum{phase="router_queue",role="router"} 0.' in metrics


async def test_http_queue_deadline_passes_with_429(tokenizer):
    async with running_router(tokenizer, prefill=[Script(load=_overloaded())], decode=[Script()],
                              admission="queue", max_queue_seconds=0.3) as h:
        start = time.monotonic()
        response = await h.http().post("/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert response.status_code == 429 and "retry-after" in response.headers
        assert 0.3 <= time.monotonic() - start < 2.0
        assert h.num_pod_requests() == 0
        assert 'reason="queue_timeout"' in (await h.http().get("/metrics")).text
