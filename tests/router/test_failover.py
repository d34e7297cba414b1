"""Failures and cancellation: disconnects cancel pod calls, retries before the first token only,
failing pods leave routing and come back after a successful probe."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import httpx
import pytest

from fake_pods import EOS_ID, Script, expected_tokens
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


async def test_client_disconnect_mid_stream_cancels_pod_calls(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(token_delay=0.05)]) as h:
        async with httpx.AsyncClient(base_url=h.url, timeout=10) as client:
            async with client.stream("POST", "/v1/completions",
                                     json={"prompt": "hello", "max_tokens": 200, "stream": True}) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                seen = 0
                async for line in lines:
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break          # leaving the block closes the connection mid-stream
        decode = h.decode[0].records
        await asyncio.wait_for(decode.cancel_seen.wait(), 5.0)
        request_id = decode.generate_requests[0].request_id
        assert decode.cancelled == [request_id]
        await _wait_for(lambda: request_id in decode.aborted and request_id in h.prefill[0].records.aborted)
        await _wait_for(lambda: all(p.num_inflight == 0 for p in h.state.dispatcher.tracker.pods.values()))


async def test_client_disconnect_during_prefill_cancels_both_pods(tokenizer):
    slow = Script(first_token_delay=5.0)
    async with running_router(tokenizer, prefill=[slow], decode=[Script(first_token_delay=5.0)]) as h:
        async with httpx.AsyncClient(base_url=h.url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        for pod in (h.prefill[0], h.decode[0]):
            await asyncio.wait_for(pod.records.cancel_seen.wait(), 5.0)
        assert 'status="cancelled"' in (await h.http().get("/metrics")).text


async def test_failing_decode_pod_is_retried_on_another_before_the_first_token(tokenizer):
    bad, good = Script(fail_generate=grpc.StatusCode.UNAVAILABLE), Script()
    # The prefill pod is slow, so the decode failure comes before any token reaches the client.
    async with running_router(tokenizer, prefill=[Script(first_token_delay=0.2)], decode=[bad, good],
                              policy="round_robin", probe_interval_seconds=30) as h:
        client = h.http()
        for _ in range(3):
            response = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6})
            assert response.status_code == 200, response.text
            expected = tokenizer.decode(expected_tokens(tokenizer.encode("abc"), 6))
            assert response.json()["choices"][0]["text"] == expected
        failing, healthy = h.decode
        assert len(failing.records.generate_requests) == 1      # tried once, then out of routing
        assert len(healthy.records.generate_requests) == 3
        assert h.state.dispatcher.tracker.pods[failing.address].routable is False
        assert 'cbserve_router_retries_total{role="router"} 1.0' in (await client.get("/metrics")).text


@contextlib.asynccontextmanager
async def one_decode_pod_breaks_midway(tokenizer):
    """Two decode pods under round robin; the first one routed to breaks after 3 tokens.
    Yields the harness and the other (healthy) pod."""
    breaks = Script(fail_generate_after=3, token_delay=0.01)
    async with running_router(tokenizer, prefill=[Script()], decode=[breaks, Script()],
                              policy="round_robin", probe_interval_seconds=30) as h:
        target = sorted(h.decode, key=lambda p: p.address)[0]
        target.script, other = breaks, [p for p in h.decode if p is not target][0]
        other.script = Script()
        yield h, other


async def test_no_retry_after_tokens_reached_the_client(tokenizer):
    async with one_decode_pod_breaks_midway(tokenizer) as (h, other):
        async with h.http().stream("POST", "/v1/completions",
                                   json={"prompt": "abc", "max_tokens": 10, "stream": True}) as response:
            assert response.status_code == 200
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "UNAVAILABLE" in error["message"]
        assert len(other.records.generate_requests) == 0      # no replay on another pod


async def test_non_streaming_request_whose_pod_breaks_midway_runs_again_elsewhere(tokenizer):
    async with one_decode_pod_breaks_midway(tokenizer) as (h, other):
        response = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 10})
        assert response.status_code == 200, response.text
        body = response.json()
        # The client sees one whole answer: the broken run's tokens are not in it twice.
        assert body["choices"][0]["text"] == tokenizer.decode(expected_tokens(tokenizer.encode("abc"), 10))
        assert body["usage"]["completion_tokens"] == 10
        assert [r.request_id.endswith("-replay1") for r in other.records.generate_requests] == [True]
        assert 'cbserve_router_retries_total{role="router"} 1.0' in (await h.http().get("/metrics")).text


async def test_failing_pod_leaves_routing_and_returns_after_a_probe(tokenizer):
    async with running_router(tokenizer, colocated=[Script(), Script()], policy="round_robin",
                              probe_interval_seconds=0.2) as h:
        first, second = sorted(h.colocated, key=lambda p: p.address)
        tracker = h.state.dispatcher.tracker
        first.script.down = True                                   # crashes: load stream and calls fail
        await _wait_for(lambda: not tracker.pods[first.address].routable)
        client = h.http()
        for _ in range(3):
            response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert response.status_code == 200
        assert len(first.records.generate_requests) == 0 and len(second.records.generate_requests) == 3
        first.script.down = False                                  # back up: the next probe succeeds
        await _wait_for(lambda: tracker.pods[first.address].routable)
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert len(first.records.generate_requests) == 1


async def test_prefill_pod_failure_falls_back_to_the_decode_pod(tokenizer):
    # The decode pod prefills locally when its prefill pod is gone (the fake just generates).
    async with running_router(tokenizer, prefill=[Script(fail_prefill=grpc.StatusCode.UNAVAILABLE)],
                              decode=[Script(eos_at=4)], probe_interval_seconds=30) as h:
        response = await h.openai().completions.create(model="fake-model", prompt="abc", max_tokens=9)
        tokens = expected_tokens(tokenizer.encode("abc"), 9, eos_at=4)
        assert tokens[-1] == EOS_ID
        assert response.choices[0].text == tokenizer.decode(tokens[:-1])
        assert response.choices[0].finish_reason == "stop"
        await _wait_for(lambda: not h.state.dispatcher.tracker.pods[h.prefill[0].address].routable)


async def test_pod_aborting_a_request_before_the_first_token_is_retried_elsewhere(tokenizer):
    async with running_router(tokenizer, colocated=[Script(abort_generate=True), Script(abort_generate=True)],
                              policy="round_robin", probe_interval_seconds=30) as h:
        first, second = sorted(h.colocated, key=lambda p: p.address)
        second.script.abort_generate = False
        response = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert response.status_code == 200
        assert len(first.records.generate_requests) == 1 and len(second.records.generate_requests) == 1
        # ABORTED is not a crash: the pod stays in routing.
        assert h.state.dispatcher.tracker.pods[first.address].routable


async def test_ready_needs_a_prefill_and_a_decode_pod(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()], probe_interval_seconds=30) as h:
        client = h.http()
        assert (await client.get("/ready")).status_code == 200
        h.decode[0].script.down = True
        await _wait_for(lambda: not h.state.dispatcher.tracker.pods[h.decode[0].address].routable)
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "no ready pods"}
        assert (await client.get("/health")).status_code == 200          # alive, just not ready


async def test_request_ended_by_the_first_token_frees_both_pods(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(first_token_delay=1.0)]) as h:
        response = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        request_id = h.prefill[0].records.prefill_requests[0].request_id
        await _wait_for(lambda: request_id in h.prefill[0].records.aborted
                        and request_id in h.decode[0].records.aborted)
        await asyncio.wait_for(h.decode[0].records.cancel_seen.wait(), 5.0)


async def test_decode_failing_because_its_prefill_pod_died_blames_the_prefill_pod(tokenizer):
    # P dies; this D has no local fallback and fails too. The retry avoids P and keeps D.
    async with running_router(tokenizer, prefill=[Script(), Script()], decode=[Script()],
                              policy="round_robin", probe_interval_seconds=30) as h:
        dead = sorted(h.prefill, key=lambda p: p.address)[0]
        dead.script.fail_prefill = grpc.StatusCode.UNAVAILABLE
        decode = h.decode[0]
        decode.script.lost_source = dead.address
        response = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert response.status_code == 200, response.text
        tracker = h.state.dispatcher.tracker
        assert not tracker.pods[dead.address].routable
        assert tracker.pods[decode.address].routable                 # D was not blamed
        assert [r.prefill_from for r in decode.records.generate_requests] == [
            dead.address, [p for p in h.prefill if p is not dead][0].address]


async def test_pod_leaving_discovery_mid_stream_finishes_the_stream(tokenizer):
    # Kubernetes marks a draining pod not ready: no new work, but its open streams must finish.
    async with running_router(tokenizer, colocated=[Script(token_delay=0.02)]) as h:
        tracker = h.state.dispatcher.tracker
        async with h.http().stream("POST", "/v1/completions",
                                   json={"prompt": "abc", "max_tokens": 30, "stream": True}) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            tracker.set_endpoints(frozenset())                    # the pod left the EndpointSlice
            assert tracker.pods == {}
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert h.colocated[0].records.cancelled == []
