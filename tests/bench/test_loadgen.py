"""The open-loop client against a tiny local SSE server whose timing and failures the test controls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbserve.goodput.loadgen import run_open_loop
from cbserve.goodput.workloads import RequestSpec

FIRST_TOKEN_S = 0.15
TOKEN_GAP_S = 0.03


def sse(body) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def chunk(text: str) -> str:
    return sse({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]})


def sse_app(seen: dict) -> FastAPI:
    """The prompt picks the behaviour: ok, reject, error, hang or endless (for cancellation)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.setdefault("bodies", []).append(body)
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if prompt == "reject":
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)

        async def stream():
            try:
                await asyncio.sleep(FIRST_TOKEN_S)
                if prompt == "hang":
                    await asyncio.sleep(30)
                if prompt == "error":
                    yield chunk("a")
                    yield sse({"error": {"message": "decode pod lost", "type": "server_error"}})
                    yield sse("[DONE]")
                    return
                # Two tokens per chunk, as a router that merges tokens may send: usage has the count.
                num_chunks = max_tokens // 2 if prompt == "ok" else 10_000
                for i in range(num_chunks):
                    if i:
                        await asyncio.sleep(TOKEN_GAP_S)
                    yield chunk("xy")
                yield sse({"object": "text_completion", "choices": [],
                           "usage": {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": 3 + max_tokens}})
                yield sse("[DONE]")
            finally:
                seen.setdefault("closed", []).append(prompt)

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextlib.asynccontextmanager
async def serving(app: FastAPI):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def run(requests: list[RequestSpec], timeout_s: float = 10.0):
    seen: dict = {}

    async def main():
        async with serving(sse_app(seen)) as url:
            return await run_open_loop(url, "m", requests, timeout_s=timeout_s)

    results, elapsed = asyncio.run(main())
    return results, elapsed, seen


def test_ttft_tpot_and_usage_token_count():
    (r,), elapsed, seen = run([RequestSpec(0, 0.0, "ok", 20)])
    assert r.outcome == "ok" and r.error is None
    assert r.num_chunks == 10 and r.num_output_tokens == 20
    assert FIRST_TOKEN_S <= r.ttft_s < FIRST_TOKEN_S + 0.5
    # 10 chunks, 9 gaps, 19 token intervals after the first: TPOT = 9 * gap / 19.
    assert r.tpot_s == pytest.approx(9 * TOKEN_GAP_S / 19, rel=0.6)
    assert r.tpot_s >= 9 * TOKEN_GAP_S / 19 * 0.99
    assert r.e2e_s >= r.ttft_s + 9 * TOKEN_GAP_S * 0.99 and elapsed >= r.e2e_s
    body = seen["bodies"][0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}


def test_requests_are_sent_on_schedule_not_after_earlier_ones_finish():
    requests = [RequestSpec(i, t, "ok", 40) for i, t in enumerate([0.0, 0.1, 0.2, 0.2])]
    results, elapsed, _ = run(requests)
    assert [r.outcome for r in results] == ["ok"] * 4
    for r in results:   # open loop: each goes out at its time even though the first is still streaming
        assert r.scheduled_s <= r.sent_s < r.scheduled_s + 0.1
    assert elapsed < 0.2 + FIRST_TOKEN_S + 20 * TOKEN_GAP_S + 1.0


def test_cancellation_closes_the_stream():
    (r,), _, seen = run([RequestSpec(0, 0.0, "endless", 100, cancel_after_tokens=3)])
    assert r.outcome == "cancelled" and r.num_chunks == 3
    assert "endless" in seen["closed"]     # the server saw the client go away


@pytest.mark.parametrize("prompt, outcome, message", [
    ("reject", "rejected", "HTTP 429"),
    ("error", "error", "decode pod lost"),
    ("hang", "timeout", "no answer within"),
])
def test_failures_are_classified(prompt, outcome, message):
    (r,), _, _ = run([RequestSpec(0, 0.0, prompt, 10)], timeout_s=1.0)
    assert r.outcome == outcome
    assert message in r.error
