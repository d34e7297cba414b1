"""Open-loop load generator: send each request at its scheduled instant, stream it, time it.

Open loop: a request is sent when its arrival time comes, whether or not earlier ones have finished
(a closed loop would slow down with the server and hide its queueing). Each request is a streaming
`/v1/completions` call over httpx; its first content chunk gives TTFT, the last one the end, and the
final usage chunk the exact output token count (the router may merge tokens into one chunk, and a
byte-level model's partial UTF-8 can make a chunk's text empty), so TPOT = (last - first) / (n - 1).
A request with `cancel_after_tokens` closes its stream after that many chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import httpx

from cbserve.goodput.stats import RequestResult
from cbserve.goodput.workloads import RequestSpec
from engine.progress import progress


def completion_body(model: str, request: RequestSpec) -> dict:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


async def _stream_one(client: httpx.AsyncClient, model: str, request: RequestSpec, result: RequestResult,
                      clock) -> None:
    async with client.stream("POST", "/v1/completions", json=completion_body(model, request)) as response:
        result.http_status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.outcome = "rejected" if response.status_code in (429, 503) else "error"
            result.error = f"HTTP {response.status_code}: {body[:200]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.outcome = "ok" if result.first_token_s is not None else "error"
                if result.outcome == "error":
                    result.error = "stream ended without a token"
                return
            event = json.loads(data)
            if "error" in event:
                result.outcome, result.error = "error", str(event["error"].get("message", event["error"]))
                return
            if event.get("choices"):
                now = clock()
                if result.first_token_s is None:
                    result.first_token_s = now
                result.last_token_s = now
                result.num_chunks += 1
                if request.cancel_after_tokens is not None and result.num_chunks >= request.cancel_after_tokens:
                    result.outcome = "cancelled"
                    result.num_output_tokens = result.num_chunks
                    return          # leaving the `async with` closes the connection: the router cancels
            if event.get("usage"):
                result.num_output_tokens = int(event["usage"]["completion_tokens"])
        result.outcome, result.error = "error", "stream closed before [DONE]"


async def _send_at(client: httpx.AsyncClient, model: str, request: RequestSpec, start: float,
                   timeout_s: float) -> RequestResult:
    def clock() -> float:
        return time.perf_counter() - start

    result = RequestResult(request.index, request.arrival_s)
    await asyncio.sleep(max(0.0, request.arrival_s - clock()))
    result.sent_s = clock()
    try:
        await asyncio.wait_for(_stream_one(client, model, request, result, clock), timeout_s)
    except asyncio.TimeoutError:
        result.outcome, result.error = "timeout", f"no answer within {timeout_s:.0f}s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        result.outcome, result.error = "error", f"{type(e).__name__}: {e}"
    result.done_s = clock()
    if result.outcome == "ok" and result.num_output_tokens == 0:
        result.num_output_tokens = result.num_chunks   # server sent no usage chunk
    return result


async def run_open_loop(base_url: str, model: str, requests: Sequence[RequestSpec], *,
                        timeout_s: float = 120.0, api_key: str | None = None,
                        desc: str = "requests") -> tuple[list[RequestResult], float]:
    """Send every request at its `arrival_s`; return the results (in request order) and the elapsed
    seconds from the start until the last request finished. A bar labelled `desc` counts finished
    requests on a terminal."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        bar = progress(desc=desc, total=len(requests), unit="req")

        async def send(request: RequestSpec) -> RequestResult:
            result = await _send_at(client, model, request, start, timeout_s)
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(send(r) for r in requests))
        elapsed = time.perf_counter() - start
        bar.close()
    return list(results), elapsed
