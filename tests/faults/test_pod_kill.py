"""SIGKILL of the decode pod mid-stream and of the prefill pod mid-transfer, behind a real router;
then each pod is restarted at the same address as a new process with a new pod id.

What a client must see: every request ends with tokens or an error before its deadline (a
stream with an SSE error event and `[DONE]`); the surviving pod holds no KV afterwards; once the
pod is back at its address, the router serves again and the decode pod pulls from the new
prefill process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.faults.cluster import Router, load, metric, start_pods, wait_idle

pytestmark = pytest.mark.slow

DEADLINE = 60.0            # the router's per-request deadline (--request-timeout-seconds)
CLIENT_SLACK = 30.0        # a client gives up this long after it: that would be a hang
# SLOs the loaded test machine cannot miss: admission must never shed these requests.
ROUTER_ARGS = ("--slo-ttft-ms", "600000", "--slo-tpot-ms", "60000", "--max-queue-seconds", "30",
               "--request-timeout-seconds", str(int(DEADLINE)))
LONG_PROMPT = " ".join(f"w{i % 97}" for i in range(300))   # ~1,200 byte tokens: many prefill steps


@pytest.fixture(scope="module")
def cluster():
    # No prefix caching on P: the kill run repeats the clean run's prompts and must find P still
    # prefilling them (chunk by chunk) while D pulls.
    prefill, decode = start_pods(("prefill", "--pod-id", "prefill-a", "--no-prefix-caching"),
                                 ("decode", "--pod-id", "decode-a"))
    router = Router([prefill], [decode], *ROUTER_ARGS)
    try:
        router.wait_ready()
        yield router, prefill, decode
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, events: list) -> tuple[str, float]:
    """One streamed completion; returns how it ended ("done", "error+done", "http <status>",
    "transport error") and when (monotonic)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    error = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"http {response.status_code}", time.monotonic()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return ("error+done" if error else "done"), time.monotonic()
                chunk = json.loads(data)
                error = error or "error" in chunk
                events.append(chunk)
    except httpx.HTTPError as e:
        return f"transport error {type(e).__name__}", time.monotonic()
    return "ended without [DONE]", time.monotonic()


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
    return response.status_code, text


def _client(router: Router) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=router.url, timeout=DEADLINE + CLIENT_SLACK, trust_env=False)


def _recovers(router: Router, prompt: str, want: str | None = None, timeout: float = 120.0) -> float:
    """Seconds until a request through the router succeeds (with `want`'s text, if given)."""
    start = time.monotonic()

    async def once():
        async with _client(router) as client:
            return await _complete(client, prompt, 12)

    while True:
        status, text = asyncio.run(once())
        if status == 200 and (want is None or text == want):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, (status, text, router.log_tail())
        time.sleep(1.0)


def test_sigkill_decode_mid_stream_then_restart_at_the_same_address(cluster):
    router, prefill, decode = cluster

    async def scenario():
        async with _client(router) as client:
            events = [[] for _ in range(4)]
            streams = [asyncio.ensure_future(_stream(client, f"story {i}:", 1500, events[i])) for i in range(4)]
            plain = asyncio.ensure_future(_complete(client, "plain one", 1500))
            started = time.monotonic()
            while min(len(e) for e in events) < 3:   # every stream is producing tokens
                assert time.monotonic() - started < DEADLINE, [len(e) for e in events]
                await asyncio.sleep(0.05)
            decode.kill(signal.SIGKILL)
            killed_at = time.monotonic()
            ends = await asyncio.gather(*streams)
            status, _ = await plain
            return killed_at, ends, status

    killed_at, ends, status = asyncio.run(scenario())
    for how, when in ends:   # a clean end for every stream, long before its deadline
        assert how == "error+done", ends
        assert when - killed_at < DEADLINE, ends
    assert status >= 500   # the non-streamed request: an error status, not a hang
    wait_idle([prefill])   # nothing held for the dead decode pod

    decode.restart("--pod-id", "decode-b").wait_ready()
    seconds = _recovers(router, "after the decode restart")
    print(f"decode restart: router served again {seconds:.1f}s after the new pod was ready")
    wait_idle([prefill, decode])


def test_sigkill_prefill_mid_transfer_then_restart_at_the_same_address(cluster):
    router, prefill, decode = cluster
    prompts = [f"{i} {LONG_PROMPT}" for i in range(4)]

    async def clean():
        async with _client(router) as client:
            return await asyncio.gather(*(_complete(client, p, 12) for p in prompts))

    reference = asyncio.run(clean())
    assert all(status == 200 for status, _ in reference), reference
    wait_idle([prefill, decode])

    async def scenario():
        async with _client(router) as client:
            requests = [asyncio.ensure_future(_complete(client, p, 12)) for p in prompts]
            started = time.monotonic()
            while True:   # P is prefilling (and D pulling as the chunks complete)
                report = await asyncio.to_thread(load, prefill)
                if report is not None and report.num_running + report.num_waiting > 0:
                    break
                assert time.monotonic() - started < DEADLINE, "the prefill pod never got the requests"
                await asyncio.sleep(0.01)
            prefill.kill(signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*requests)
            return killed_at, results, time.monotonic()

    killed_at, results, ended_at = asyncio.run(scenario())
    assert ended_at - killed_at < DEADLINE + 5, results
    for (status, text), (_, want) in zip(results, reference):
        if status == 200:   # finished by the decode pod's local prefill: the same greedy text
            assert text == want
        else:
            assert status >= 500 or status == 429, results
    wait_idle([decode])     # no KV left on the survivor
    print(f"prefill killed: statuses {[status for status, _ in results]}, all ended {ended_at - killed_at:.1f}s after")

    before = metric(decode, "cbserve_kv_transfer_bytes_total")
    prefill.restart("--pod-id", "prefill-b").wait_ready()
    seconds = _recovers(router, prompts[0], reference[0][1])
    deadline = time.monotonic() + 120
    while metric(decode, "cbserve_kv_transfer_bytes_total") <= before:   # D pulls from the new process
        assert time.monotonic() < deadline, "the decode pod never pulled from the restarted prefill pod"
        _recovers(router, prompts[1], reference[1][1])
    print(f"prefill restart: router served again {seconds:.1f}s after the new pod was ready")
    wait_idle([prefill, decode])
