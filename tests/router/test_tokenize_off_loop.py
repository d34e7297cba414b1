"""Tokenization runs off the event loop: a slow encode does not stall other requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio


class SlowTokenizer:
    """The real tokenizer, but encoding takes a second (as a very large prompt would)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def encode(self, text, add_special_tokens=True):
        time.sleep(1.0)
        return self._inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def test_slow_tokenization_does_not_block_other_requests(tokenizer):
    async with running_router(SlowTokenizer(tokenizer), colocated=[Script()]) as h:
        client = h.http()
        start = time.monotonic()
        completion = asyncio.create_task(client.post("/v1/completions", json={"prompt": "big", "max_tokens": 2}))
        await asyncio.sleep(0.1)
        latencies = []
        for _ in range(5):
            t = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.monotonic() - t)
        assert max(latencies) < 0.5
        assert (await completion).status_code == 200
        assert time.monotonic() - start >= 1.0


async def test_real_tokenizer_releases_the_gil_while_it_encodes(tokenizer):
    """A thread alone is not enough: `tokenizers`' plain `encode` holds the GIL for the whole call,
    so a long prompt encoded "off the loop" still froze it (the probe's 10 MB prompt: /health took
    8.75 s). `Tokenizer.encode` now releases it. The prompt is within the character bound (a long
    context), so it really is tokenized, then refused for its token count."""
    async with running_router(tokenizer, colocated=[Script()], max_model_len=200_000) as h:
        client = h.http()
        prompt = "abc " * 100_000                                    # 400k characters and tokens
        start = time.monotonic()
        completion = asyncio.create_task(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}))
        latencies = []
        while not completion.done():
            t = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(0.01)
        response = await completion
        print(f"\n400k-token prompt tokenized and refused in {time.monotonic() - start:.2f}s; "
              f"/health worst {max(latencies) * 1000:.0f} ms over {len(latencies)} polls")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert "400001 tokens" in response.json()["error"]["message"]
        assert max(latencies) < 2.0
