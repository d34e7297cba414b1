"""Nothing leaks: after a burst of mixed outcomes every counter the router keeps is back to zero."""

from __future__ import annotations

import asyncio
import random

import grpc
import httpx
import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def test_burst_with_disconnects_rejections_and_failures_leaves_no_residue(tokenizer):
    rng = random.Random(0)
    async with running_router(tokenizer, prefill=[Script(first_token_delay=0.01), Script(first_token_delay=0.01)],
                              decode=[Script(token_delay=0.005), Script(token_delay=0.005,
                                                                        fail_generate=grpc.StatusCode.UNAVAILABLE)],
                              policy="least_loaded", admission="queue", max_queue_size=8,
                              probe_interval_seconds=0.3) as h:
        async def one(i: int) -> int | str:
            body = {"prompt": f"p{i}", "max_tokens": rng.randint(1, 12), "stream": i % 2 == 0, "n": 1 + i % 2}
            timeout = 0.05 if i % 7 == 0 else 10          # some clients give up mid-request
            try:
                async with httpx.AsyncClient(base_url=h.url, timeout=timeout) as client:
                    response = await client.post("/v1/completions", json=body)
                    return response.status_code
            except httpx.TimeoutException:
                return "gone"

        outcomes = await asyncio.gather(*[one(i) for i in range(60)])
        assert outcomes.count(200) >= 30 and "gone" in outcomes
        assert set(outcomes) <= {200, 429, 502, 503, "gone"}
        state = h.state

        def settled() -> bool:
            return (all(p.num_inflight == p.num_answered == 0 for p in state.dispatcher.tracker.pods.values())
                    and state.dispatcher.admission.num_waiting == 0)

        for _ in range(100):
            if settled():
                break
            await asyncio.sleep(0.05)
        assert settled()
        metrics = (await h.http().get("/metrics")).text
        assert 'cbserve_requests_running{role="router"} 0.0' in metrics
        assert 'cbserve_requests_waiting{role="router"} 0.0' in metrics


async def test_a_prefill_pod_stops_counting_a_sequence_once_it_answered(tokenizer):
    # P answers at once; D streams slowly. While D streams, the sequence is no longer P's load
    # (its TTFT model would price every queued prompt's steps at the whole cluster's batch), yet
    # P's in-flight count keeps its channel open until the end (an Abort may still be sent to it).
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(token_delay=0.05)],
                              policy="least_loaded") as h:
        pods = {p.role: p for p in h.state.dispatcher.tracker.pods.values()}
        prefill, decode = pods["prefill"], pods["decode"]
        async with httpx.AsyncClient(base_url=h.url, timeout=10) as client:
            streaming = asyncio.ensure_future(client.post("/v1/completions",
                                                          json={"prompt": "p", "max_tokens": 30, "stream": True}))
            for _ in range(100):      # P's answer, then its next load report (the dispatch it counted)
                if prefill.num_answered and prefill.num_requests == 0:
                    break
                await asyncio.sleep(0.01)
            assert not streaming.done()
            assert (prefill.num_inflight, prefill.num_answered) == (1, 1) and prefill.num_requests == 0
            assert decode.num_inflight == 1 and decode.num_requests >= 1
            assert (await streaming).status_code == 200
        for _ in range(100):
            if prefill.num_inflight == decode.num_inflight == 0:
                break
            await asyncio.sleep(0.01)
        assert (prefill.num_inflight, prefill.num_answered, decode.num_inflight) == (0, 0, 0)
