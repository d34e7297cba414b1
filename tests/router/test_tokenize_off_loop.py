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
