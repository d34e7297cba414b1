"""A real router (uvicorn on 127.0.0.1) in front of fake pods, all in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import uvicorn

from engine.tokenizer import Tokenizer, build_byte_level_tokenizer
from router.app import create_app
from router.config import RouterConfig
from fake_pods import FakePod, Script, start_pods


@dataclass
class Harness:
    url: str
    app: object
    prefill: list[FakePod] = field(default_factory=list)
    decode: list[FakePod] = field(default_factory=list)
    colocated: list[FakePod] = field(default_factory=list)
    clients: list = field(default_factory=list)

    @property
    def pods(self) -> list[FakePod]:
        return [*self.prefill, *self.decode, *self.colocated]

    @property
    def state(self):
        return self.app.state.serving

    def openai(self, **kwargs) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"),
                                    max_retries=0, **kwargs)
        self.clients.append(client)
        return client

    def http(self) -> httpx.AsyncClient:
        client = httpx.AsyncClient(base_url=self.url, timeout=30)
        self.clients.append(client)
        return client

    def num_pod_requests(self) -> int:
        return sum(p.records.num_requests for p in self.pods)

    async def wait_routable(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(p.routable for p in self.state.dispatcher.tracker.pods.values()) < count:
            assert time.monotonic() < deadline, "pods did not become routable"
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serve_app(app):
    """Serve `app` with uvicorn on a free 127.0.0.1 port in this event loop; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "router failed to start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@contextlib.asynccontextmanager
async def running_router(tokenizer, *, prefill: list[Script] = (), decode: list[Script] = (),
                         colocated: list[Script] = (), pod_interceptors=(), wait_routable: int | None = None,
                         **config):
    """Start fake pods (with `pod_interceptors` on their servers) and a router over them; yields
    a Harness once every pod is routable (or `wait_routable` of them: 0 for pods that start down)."""
    pods = {"prefill": await start_pods("prefill", list(prefill), pod_interceptors),
            "decode": await start_pods("decode", list(decode), pod_interceptors),
            "colocated": await start_pods("colocated", list(colocated), pod_interceptors)}
    config.setdefault("probe_interval_seconds", 0.2)
    config.setdefault("api_key_env", None)
    router_config = RouterConfig(model="fake-model", **{role: tuple(p.address for p in pods[role]) for role in pods},
                                 **config)
    app = create_app(router_config, tokenizer=tokenizer, default_max_model_len=256)
    try:
        async with serve_app(app) as url:
            harness = Harness(url, app, **pods)
            await harness.wait_routable(len(harness.pods) if wait_routable is None else wait_routable)
            try:
                yield harness
            finally:
                for client in harness.clients:
                    await (client.aclose() if hasattr(client, "aclose") else client.close())
    finally:
        for role_pods in pods.values():
            for pod in role_pods:
                await pod.stop()


class LoopThread:
    """An async context manager (`factory()`) entered in its own event loop in a thread, for sync
    tests (hypothesis) and module-scoped fixtures; `value` is what it yields."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.value = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def harness(self):
        return self.value

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with self._factory() as value:
                self.value = value
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:       # surfaced by __enter__
            self._error = exc
            self._ready.set()

    def __enter__(self) -> LoopThread:
        self._thread.start()
        assert self._ready.wait(60), "router did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def RouterThread(tokenizer, **kwargs) -> LoopThread:
    """`running_router` (same arguments) in a thread; its `harness` is the Harness."""
    return LoopThread(lambda: running_router(tokenizer, **kwargs))


def byte_tokenizer_with_template(directory, template: str, special_tokens=()) -> Tokenizer:
    """The presets' byte-level tokenizer with another chat template (and extra special tokens)."""
    path = build_byte_level_tokenizer(directory)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    if special_tokens:
        config["additional_special_tokens"] = list(special_tokens)
    config_file.write_text(json.dumps(config))
    return Tokenizer.from_pretrained(path)
