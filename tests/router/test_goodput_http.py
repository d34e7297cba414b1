"""goodput over HTTP: the router reads the pods' load reports and sends work where the SLO holds."""

from __future__ import annotations

import pytest

from wire import cbserve_pb2 as pb
from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def test_requests_go_to_the_pods_with_headroom(tokenizer):
    busy_prefill = Script(load=pb.LoadReport(prefill_queue_tokens=450, prefill_tokens_per_second=1000))
    idle_prefill = Script(load=pb.LoadReport(prefill_queue_tokens=0, prefill_tokens_per_second=1000))
    slow_decode = Script(load=pb.LoadReport(step_seconds_ewma=0.045))
    fast_decode = Script(load=pb.LoadReport(step_seconds_ewma=0.005))
    async with running_router(tokenizer, prefill=[busy_prefill, idle_prefill], decode=[slow_decode, fast_decode],
                              policy="goodput") as h:
        client = h.http()
        for i in range(6):
            response = await client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2})
            assert response.status_code == 200
        busy_p, idle_p = h.prefill
        slow_d, fast_d = h.decode
        assert len(idle_p.records.prefill_requests) == 6 and not busy_p.records.prefill_requests
        assert len(fast_d.records.generate_requests) == 6 and not slow_d.records.generate_requests
        for request in fast_d.records.generate_requests:
            assert request.prefill_from == idle_p.address
