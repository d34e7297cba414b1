"""Router CPU per output token: the router's own cost of streaming tokens, with fake pods.

Fake pods (tests/router/fake_pods.py: real grpc.aio servers on loopback, no model) answer every
Generate at once with `--num-tokens` tokens, `k` tokens per GenerateResponse (a real decode pod
sends one message per engine step). A router runs in its own process in front of them and
`--concurrency` streaming /v1/completions run through it over httpx until `--requests` finished.
The router's CPU seconds come from /proc/<pid>/stat (utime + stime), read around the measured
batch only (a warm-up batch comes first); tokens are counted from each stream's usage chunk, and
every stream's text is checked against what the fake model says it must be.

`--tree NAME=PATH` runs the router from another checkout (its `router/` and `engine/` on
PYTHONPATH; pods and this driver always come from this checkout), so a base and a changed router
are measured side by side in one run, alternating, `--rounds` times each; the table shows medians.

    git worktree add /tmp/router-base HEAD   # before the change
    .venv/bin/python bench/router_overhead.py --tree base=/tmp/router-base --tree new=. [--pd]
    ... --tree new-uvloop=.@/tmp/uvenv/bin/python     # the same router on uvloop + httptools

`--in-process` measures the router's own Python alone: the app is called through ASGI (no server,
no sockets) over fake pod clients whose Generate hands out prebuilt messages, one loop turn each;
the CPU is the process's `time.process_time()` around the measured batch.

us_per_token is router CPU (all threads) per output token, loop_us_per_token the part of it on the
main thread (the event loop: the router's Python, HTTP and the Python side of grpc.aio; the rest
is gRPC core's own threads); tokens/s is end to end on this machine, where the pods and the client
share the cores: a comparison between trees, not a capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """utime + stime of a process (or one of its threads), from /proc: fields 14 and 15."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


# -- the two child processes ------------------------------------------------------------------------
async def serve_pods(tokens_per_message: int, pd: bool) -> None:
    """Fake pods in this process; prints their addresses as one JSON line, then serves forever."""
    sys.path.insert(0, str(REPO / "tests" / "router"))
    from fake_pods import FakePod, Script

    script = Script(tokens_per_message=tokens_per_message, max_model_len=4096)
    roles = ("prefill", "decode") if pd else ("colocated",)
    pods = {role: await FakePod(role, script, pod_id=f"bench-{role}").start() for role in roles}
    print(json.dumps({role: pod.address for role, pod in pods.items()}), flush=True)
    await asyncio.Event().wait()


def serve_router(addresses: dict[str, str]) -> None:
    """The router (from whatever tree is on PYTHONPATH) on a free port; prints the port, then serves
    as `cbserve router` does: uvicorn runs the loop, "auto" picks uvloop and httptools if installed."""
    import socket

    import uvicorn

    from engine.tokenizer import Tokenizer, build_byte_level_tokenizer
    from router.app import create_app
    from router.config import RouterConfig

    tokenizer = Tokenizer.from_pretrained(build_byte_level_tokenizer(Path(tempfile.mkdtemp())))
    config = RouterConfig(model="fake-model", api_key_env=None, probe_interval_seconds=0.5,
                          request_timeout_seconds=600, **{role: (a,) for role, a in addresses.items()})
    app = create_app(config, tokenizer=tokenizer, default_max_model_len=4096)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


# -- in process: the router's own Python, without sockets or gRPC ----------------------------------
class _FakeCall:
    """A Generate call that hands out prebuilt messages, one loop turn each (as a network read)."""

    def __init__(self, messages: list) -> None:
        self._messages = iter(messages)

    async def read(self):
        import grpc

        await asyncio.sleep(0)
        return next(self._messages, grpc.aio.EOF)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        try:
            return next(self._messages)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> bool:
        return True


class _FakeWatch:
    """A WatchLoad call: the same report every interval until cancelled."""

    def __init__(self, report, interval_seconds: float) -> None:
        self._report, self._interval, self._first = report, interval_seconds, True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._first:
            await asyncio.sleep(self._interval)
        self._first = False
        return self._report

    def cancel(self) -> bool:
        return True


def _fake_pod_client(tokens_per_message: int):
    """A stand-in for router.pod_client.PodClient: answers at once, never touches a socket."""
    sys.path.insert(0, str(REPO / "tests" / "router"))
    from fake_pods import expected_tokens

    from wire import cbserve_pb2 as pb

    messages: dict[tuple, list] = {}

    class FakePodClient:
        def __init__(self, address: str, role: str) -> None:
            self.address, self.role = address, role

        async def close(self) -> None:
            pass

        async def handshake(self, timeout: float):
            return pb.HandshakeResponse(pod_id=self.address, kv_transports=["grpc"], model=pb.ModelInfo(
                model_name="fake", max_model_len=4096, vocab_size=260, block_size=16))

        async def get_load(self, timeout: float):
            return pb.LoadReport(pod_id=self.address, role=self.role)

        def watch_load(self, interval_seconds: float):
            return _FakeWatch(pb.LoadReport(pod_id=self.address, role=self.role), interval_seconds)

        def generate(self, request, timeout: float) -> _FakeCall:
            key = (tuple(request.prompt_token_ids), request.sampling.max_tokens)
            if key not in messages:           # built once per prompt: not the router's cost
                tokens, k = expected_tokens(*key), tokens_per_message
                batches = [(i, tokens[i:i + k], i + k >= len(tokens)) for i in range(0, len(tokens), k)]
                messages[key] = [pb.GenerateResponse(
                    index=i, token_ids=ids, logprobs=[pb.TokenLogprobs(logprob=-0.5)] * len(ids), finished=last,
                    finish_reason="length" if last else "") for i, ids, last in batches]
            return _FakeCall(messages[key])

        async def abort(self, request_id: str, timeout: float = 1.0) -> None:
            pass

    return FakePodClient


async def _in_process(tokens_per_message: int, args: argparse.Namespace) -> dict[str, float]:
    """Drive the app through ASGI (no server, no sockets) over fake pod clients; process CPU."""
    import router.load
    from engine.tokenizer import Tokenizer, build_byte_level_tokenizer
    from router.app import create_app
    from router.config import RouterConfig

    router.load.PodClient = _fake_pod_client(tokens_per_message)
    tokenizer = Tokenizer.from_pretrained(build_byte_level_tokenizer(Path(tempfile.mkdtemp())))
    config = RouterConfig(model="fake-model", api_key_env=None, colocated=("fake:1",), request_timeout_seconds=600)
    app = create_app(config, tokenizer=tokenizer, default_max_model_len=4096)
    num_chunks = 0

    async def one(prompt: str) -> None:
        nonlocal num_chunks
        body = json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": args.num_tokens, "stream": True,
                           "ignore_eos": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        done = asyncio.Event()
        sent = [False]

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal num_chunks
            if message["type"] == "http.response.body":
                num_chunks += 1
                if not message.get("more_body"):
                    done.set()

        await app(scope, receive, send)

    async def batch(num_requests: int) -> None:
        prompts = [f"p{i % 17}" for i in range(num_requests)]

        async def worker() -> None:
            while prompts:
                await one(prompts.pop())
        await asyncio.gather(*[worker() for _ in range(args.concurrency)])

    async with app.router.lifespan_context(app):
        while not app.state.serving.dispatcher.is_ready():
            await asyncio.sleep(0.01)
        await batch(args.concurrency)                                          # warm-up
        num_chunks = 0
        cpu = time.process_time()
        await batch(args.requests)
        cpu = time.process_time() - cpu
    tokens = args.requests * args.num_tokens
    return {"us_per_token": 1e6 * cpu / tokens, "us_per_message": 1e6 * cpu / (tokens / tokens_per_message),
            "chunks": num_chunks}


# -- the driver ------------------------------------------------------------------------------------
def _spawn(args: list[str], pythonpath: str, python: str = sys.executable) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([python, __file__, *args], env=env, stdout=subprocess.PIPE, text=True)


def expected_text(prompt: str, num_tokens: int) -> str:
    """The fake model's output for `prompt` (byte-level tokenizer: byte b is id 4 + b, plus BOS)."""
    sys.path.insert(0, str(REPO / "tests" / "router"))
    from fake_pods import BYTE_OFFSET, expected_tokens

    prompt_ids = [1] + [BYTE_OFFSET + b for b in prompt.encode()]
    return bytes(t - BYTE_OFFSET for t in expected_tokens(prompt_ids, num_tokens)).decode()


async def _one(client: httpx.AsyncClient, prompt: str, num_tokens: int) -> tuple[int, str]:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": num_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        raw = b"".join([part async for part in response.aiter_raw()])
    text, tokens = [], 0
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[6:])
        text += [c["text"] for c in chunk["choices"]]
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return tokens, "".join(text)


async def _batch(url: str, num_requests: int, concurrency: int, num_tokens: int) -> tuple[int, float, float]:
    """(output tokens, wall seconds, client CPU seconds) of `num_requests` streams, `concurrency` at once."""
    prompts = [f"p{i % 17}" for i in range(num_requests)]
    expected = {p: expected_text(p, num_tokens) for p in set(prompts)}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        queue = list(reversed(prompts))
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                prompt = queue.pop()
                tokens, text = await _one(client, prompt, num_tokens)
                assert tokens == num_tokens and text == expected[prompt], (tokens, text, expected[prompt])
                total += tokens

        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return total, time.perf_counter() - wall, time.process_time() - cpu


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready").status_code == 200
    except httpx.ConnectError:          # the socket is bound, uvicorn not listening yet
        return False


def measure(tree: Path, python: str, tokens_per_message: int, args: argparse.Namespace) -> dict[str, float]:
    pods = _spawn(["--serve-pods", str(tokens_per_message)] + (["--pd"] if args.pd else []), str(REPO))
    router = None
    try:
        addresses = json.loads(pods.stdout.readline())
        router = _spawn(["--serve-router", json.dumps(addresses)], f"{tree}:{REPO}", python)
        url = f"http://127.0.0.1:{int(router.stdout.readline())}"
        deadline = time.monotonic() + 30
        while not _ready(url):
            assert time.monotonic() < deadline, "router never became ready"
            time.sleep(0.05)
        asyncio.run(_batch(url, args.concurrency, args.concurrency, args.num_tokens))       # warm-up
        before = cpu_seconds(router.pid), cpu_seconds(router.pid, router.pid), cpu_seconds(pods.pid)
        tokens, wall, client_cpu = asyncio.run(_batch(url, args.requests, args.concurrency, args.num_tokens))
        after = cpu_seconds(router.pid), cpu_seconds(router.pid, router.pid), cpu_seconds(pods.pid)
        router_cpu, loop_cpu, pods_cpu = (b - a for a, b in zip(before, after))
    finally:
        for proc in (router, pods):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return {"us_per_token": 1e6 * router_cpu / tokens,
            "loop_us_per_token": 1e6 * loop_cpu / tokens,
            "us_per_message": 1e6 * router_cpu / (tokens / tokens_per_message),
            "tokens_per_s": tokens / wall, "router_cpu_s": router_cpu, "pods_cpu_s": pods_cpu,
            "client_cpu_s": client_cpu, "wall_s": wall}


def measure_in_process(tree: Path, python: str, tokens_per_message: int, args: argparse.Namespace) -> dict:
    command = [python, __file__, "--in-process-run", str(tokens_per_message), "--num-tokens", str(args.num_tokens),
               "--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    env = {**os.environ, "PYTHONPATH": f"{tree}:{REPO}"}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH[@PYTHON]",
                        help="a checkout whose router to measure, optionally with another interpreter "
                             "(one with uvloop and httptools, say); repeatable; default: this one")
    parser.add_argument("--tokens-per-message", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=256, help="measured requests per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pd", action="store_true", help="a prefill and a decode pod instead of a colocated one")
    parser.add_argument("--in-process", action="store_true",
                        help="the app driven through ASGI over fake pod clients: the router's Python alone")
    parser.add_argument("--in-process-run", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-pods", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-router", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_pods is not None:
        return asyncio.run(serve_pods(args.serve_pods, args.pd))
    if args.serve_router is not None:
        return serve_router(json.loads(args.serve_router))
    if args.in_process_run is not None:
        print(json.dumps(asyncio.run(_in_process(args.in_process_run, args))))
        return None

    trees = []
    for spec in args.tree or [f"this={REPO}"]:
        name, where = spec.split("=", 1)
        path, _, python = where.partition("@")
        trees.append((name, Path(path).resolve(), python or sys.executable))
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for k in args.tokens_per_message:
            for name, path, python in trees:   # alternate trees so drift hits both alike
                results.setdefault((name, k), []).append(
                    measure_in_process(path, python, k, args) if args.in_process else measure(path, python, k, args))
    if args.in_process:
        print(f"in process (ASGI, fake pod clients, no sockets), {args.num_tokens} tokens/request, "
              f"{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}; medians")
        columns = ("us_per_token", "us_per_message", "chunks")
    else:
        mode = "prefill+decode" if args.pd else "colocated"
        print(f"{mode}, {args.num_tokens} tokens/request, {args.requests} requests x {args.rounds} rounds, "
              f"concurrency {args.concurrency}; medians")
        columns = ("us_per_token", "loop_us_per_token", "us_per_message", "tokens_per_s", "router_cpu_s",
                   "pods_cpu_s", "client_cpu_s")
    print(f"{'tree':<8} {'tok/msg':>7} " + " ".join(f"{c:>14}" for c in columns))
    for (name, k), runs in results.items():
        row = [statistics.median(r[c] for r in runs) for c in columns]
        print(f"{name:<8} {k:>7} " + " ".join(f"{v:>14.2f}" for v in row))


if __name__ == "__main__":
    main()
