"""A client that goes away is an ordinary event: one INFO line, no ERROR, no traceback (issue 11, case 9).

Before, a client that closed its connection while sending the body got two ERROR tracebacks
(the app's handler, then uvicorn's "Exception in ASGI application").
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def disconnects(self) -> list[logging.LogRecord]:
        return [r for r in self.records if "disconnected" in r.getMessage()]

    def errors(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.fixture
def records():
    """Every record of the router's and uvicorn's loggers (attached after uvicorn configured its own)."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("router", "uvicorn", "uvicorn.error")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    yield handler, loggers
    for lg, (level, propagate) in zip(loggers, saved):
        lg.removeHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


def _attach(handler: Records, loggers: list[logging.Logger]) -> None:
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    logging.getLogger("uvicorn.error").propagate = False      # one copy per record (uvicorn's own)


async def _wait_for(handler: Records, count: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while len(handler.disconnects()) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_disconnect_mid_body_is_one_info_line(tokenizer, records):
    handler, loggers = records
    async with running_router(tokenizer, colocated=[Script()]) as h:
        _attach(handler, loggers)
        host, port = h.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"prompt\": \"")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        await _wait_for(handler, 1)
        await asyncio.sleep(0.5)                                   # room for a second, wrong, record
        ok = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert ok.status_code == 200
    (record,) = handler.disconnects()
    assert record.levelno == logging.INFO and record.exc_info is None
    assert not handler.errors(), [r.getMessage() for r in handler.errors()]


async def test_disconnect_mid_stream_is_one_info_line(tokenizer, records):
    handler, loggers = records
    async with running_router(tokenizer, colocated=[Script(token_delay=0.05)]) as h:
        _attach(handler, loggers)
        async with httpx.AsyncClient(base_url=h.url, timeout=30) as client:
            body = {"prompt": "hi", "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = 0
                async for _ in response.aiter_lines():
                    lines += 1
                    if lines > 3:
                        break
        await _wait_for(handler, 1)
        await h.colocated[0].records.cancel_seen.wait()
        await asyncio.sleep(0.5)
    (record,) = handler.disconnects()
    assert record.levelno == logging.INFO and record.exc_info is None and "mid-stream" in record.getMessage()
    assert not handler.errors(), [r.getMessage() for r in handler.errors()]


async def test_disconnect_before_the_response_is_one_info_line(tokenizer, records):
    handler, loggers = records
    async with running_router(tokenizer, colocated=[Script(first_token_delay=5.0)]) as h:
        _attach(handler, loggers)
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=h.url, timeout=0.5) as client:
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        await _wait_for(handler, 1)
        await asyncio.sleep(0.5)
    (record,) = handler.disconnects()
    assert record.levelno == logging.INFO and record.exc_info is None
    assert not handler.errors(), [r.getMessage() for r in handler.errors()]
