"""Startup and scale-from-zero through a real router: a request that finds the pods known but not
ready yet waits for them (bounded by `--startup-wait-seconds` and its deadline) instead of a 503;
`/v1/models` and `/ready` answer 503 with Retry-After until a pod can serve."""

from __future__ import annotations

import asyncio
import time

import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio
BODY = {"prompt": "hi", "max_tokens": 4}


async def test_a_request_sent_before_the_pods_are_ready_is_served_once_they_are(tokenizer):
    prefill, decode = Script(down=True), Script(down=True)      # known to discovery, still loading
    async with running_router(tokenizer, prefill=[prefill], decode=[decode], wait_routable=0,
                              max_queue_seconds=0.5) as h:
        client = h.http()
        models = await client.get("/v1/models")
        assert models.status_code == 503 and models.headers["retry-after"] == "5"
        assert models.json()["error"]["code"] == "no_ready_pods"
        ready = await client.get("/ready")
        assert ready.status_code == 503 and "retry-after" in ready.headers
        pending = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(4)]
        await asyncio.sleep(1.0)             # longer than max_queue_seconds and the TTFT SLO
        assert not any(task.done() for task in pending)
        assert (await client.get("/metrics")).text.count("cbserve_requests_waiting{role=\"router\"} 4.0") == 1
        prefill.down = decode.down = False   # the pods finished loading
        responses = await asyncio.wait_for(asyncio.gather(*pending), 10.0)
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        models = await client.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["fake-model"]


async def test_past_the_startup_wait_a_request_gets_503_with_retry_after(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(down=True)], wait_routable=1,
                              startup_wait_seconds=0.5) as h:
        start = time.monotonic()
        response = await h.http().post("/v1/completions", json=BODY)
        assert 0.5 <= time.monotonic() - start < 5.0
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "no_ready_pods"
        assert 'cbserve_rejected_total{reason="startup_timeout",role="router"} 1.0' in (await h.http().get("/metrics")).text
        assert h.num_pod_requests() == 0


async def test_a_pod_restarting_under_load_is_waited_for(tokenizer):
    # The only decode pod goes down (a crash: its supervisor restarts it) and comes back.
    decode = Script()
    async with running_router(tokenizer, prefill=[Script()], decode=[decode], max_queue_seconds=0.5) as h:
        client = h.http()
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        decode.down = True
        deadline = time.monotonic() + 10
        while h.state.dispatcher.is_ready():          # the load stream notices
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        pending = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.8)
        assert not pending.done()
        decode.down = False
        response = await asyncio.wait_for(pending, 10.0)
        assert response.status_code == 200, response.text
