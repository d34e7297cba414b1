"""SIGTERM drain: /ready goes 503 at once, in-flight streams finish, then the server exits."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import httpx
import pytest
import uvicorn

from fake_pods import Script, start_pods
from router.app import create_app
from router.config import RouterConfig
from router.drain import DrainingServer

pytestmark = pytest.mark.anyio


async def _serve(tokenizer, drain_seconds: float, token_delay: float):
    pods = await start_pods("colocated", [Script(token_delay=token_delay)])
    config = RouterConfig(model="fake-model", colocated=(pods[0].address,), api_key_env=None,
                          drain_seconds=drain_seconds)
    app = create_app(config, tokenizer=tokenizer, default_max_model_len=256)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), app, drain_seconds)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=url) as client:
        while (await client.get("/ready")).status_code != 200:
            await asyncio.sleep(0.02)
    return server, task, url, pods, sock


async def test_sigterm_drains_in_flight_stream_then_exits(tokenizer):
    server, task, url, pods, sock = await _serve(tokenizer, drain_seconds=10.0, token_delay=0.02)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            async with client.stream("POST", "/v1/completions",
                                     json={"prompt": "a", "max_tokens": 40, "stream": True}) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                server.handle_exit(signal.SIGTERM, None)
                async with httpx.AsyncClient(base_url=url) as probe:
                    assert (await probe.get("/ready")).status_code == 503
                assert not task.done()
                rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]"                 # the stream finished normally
        await asyncio.wait_for(task, 5.0)                     # ... and then the server exited
    finally:
        sock.close()
        await pods[0].stop()


async def test_drain_gives_up_after_drain_seconds(tokenizer):
    server, task, url, pods, sock = await _serve(tokenizer, drain_seconds=0.5, token_delay=1.0)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 50}))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.wait_for(task, 5.0)
            assert time.monotonic() - start < 3.0
            pending.cancel()
    finally:
        sock.close()
        await pods[0].stop()


def test_router_process_exits_cleanly_on_sigterm(tmp_path):
    """The real signal path: `router.app.run` in a process, SIGTERM, exit code 0 (nothing in flight)."""
    import os
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    code = ("from router.app import run; from router.config import RouterConfig; "
            f"run(RouterConfig(model='tiny', port={port}, colocated=('127.0.0.1:1',), api_key_env=None, "
            "drain_seconds=5))")
    env = {**os.environ, "CBSERVE_CACHE_DIR": str(tmp_path)}
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL) as proc:
        _sigterm_and_wait(proc, port)


def _sigterm_and_wait(proc, port: int) -> None:
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503   # no pod answers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
