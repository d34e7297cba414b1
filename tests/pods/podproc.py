"""Real pod processes on 127.0.0.1 for integration tests (`python -m cbserve.cli prefill|decode`).

Pods start with the test deployment secret `SECRET` (in the environment, as `cbserve up` does):
talk to them through `pod_channel` (it adds the secret to every call), and name a prefill pod in
a `GenerateRequest` only through `vouched(request)`, which adds the router's KV handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.handles import KVHandles
from pod.auth import SECRET_ENV, auth_metadata, client_auth
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
SECRET = "podproc-test-cluster-secret"
AUTH = auth_metadata(SECRET)          # per-call metadata for sync stubs
HANDLES = KVHandles.from_secret(SECRET)


def pod_channel(address: str, **kw) -> grpc.aio.Channel:
    """An aio channel to a test pod that carries the deployment secret on every call."""
    return grpc.aio.insecure_channel(address, interceptors=client_auth(SECRET), **kw)


def vouched(request: pb.GenerateRequest, ttl: float = 300.0) -> pb.GenerateRequest:
    """`request` with the router's KV handle for its `prefill_from` (what `PodClient.vouch` adds)."""
    request.kv_handle.CopyFrom(HANDLES.issue(request.request_id, request.prefill_from, time.time() + ttl))
    return request


def get_load(address: str, role: str, metadata=AUTH) -> pb.LoadReport:
    """One GetLoad from the pod at `address` (`metadata`: its cluster's secret)."""
    with grpc.insecure_channel(address) as channel:
        stub = (pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub)(channel)
        return stub.GetLoad(pb.LoadRequest(), timeout=5, metadata=metadata)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    def __init__(self, role: str, *args: str, env: dict | None = None, health_port: bool = False) -> None:
        """`health_port`: serve health on a separate plaintext port too (pods serving TLS)."""
        self.role = role
        self.args = args
        self.health_port = health_port
        self.env = {**os.environ, "CBSERVE_NUM_THREADS": "1", SECRET_ENV: SECRET, **(env or {})}
        self.log = Path(tempfile.mkstemp(prefix=f"cbserve-{role}-", suffix=".log")[1])
        self._spawn()

    def _spawn(self, port: int | None = None, metrics_port: int | None = None) -> None:
        # Free ports are found, released, then bound by the child: another process can take one in
        # between, so wait_ready() respawns on "Address already in use".
        self.port, self.metrics_port = port or free_port(), metrics_port or free_port()
        self.address = self.health_address = f"127.0.0.1:{self.port}"
        extra = []
        if self.health_port:
            health = free_port()
            self.health_address = f"127.0.0.1:{health}"
            extra = ["--health-port", str(health)]
        cmd = [sys.executable, "-m", "cbserve.cli", "--log-level", "INFO", self.role, "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--max-num-batched-tokens", "64", *extra, *self.args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self.log.open("a"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 90.0, retries: int = 3) -> "Pod":
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.health_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and "Address already in use" in self.log_tail() and retries:
                    retries -= 1
                    self._spawn()
                    return self.wait_ready(timeout, retries)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.role} pod exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.role} pod not ready after {timeout}s:\n{self.log_tail()}")

    def load(self) -> pb.LoadReport:
        return get_load(self.address, self.role)

    def wait_free_blocks(self, expected: int, timeout: float) -> float:
        """Seconds until the pod reports `expected` free blocks; raises after `timeout`."""
        start = time.monotonic()
        while True:
            report = self.load()
            if report.num_free_blocks == expected and report.num_held_kv == 0:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{self.role}: {report.num_free_blocks} free blocks, expected {expected} "
                                     f"({report.num_held_kv} held) after {timeout}s")
            time.sleep(0.02)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def restart(self, *extra_args: str) -> "Pod":
        """SIGKILL this pod (if alive) and start a new process on the same ports: the same
        address with a new identity (`extra_args`, e.g. a new `--pod-id`, are added). Does not wait."""
        self.kill()
        self.proc.wait(15)
        self.args = (*self.args, *extra_args)
        with self.log.open("a") as f:
            f.write("\n----- restarted -----\n")
        self._spawn(self.port, self.metrics_port)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(5)


@contextlib.contextmanager
def pod_pair(*args: str):
    """A ready prefill pod and decode pod started with the same `args`; both stopped on exit."""
    prefill, decode = Pod("prefill", *args), Pod("decode", *args)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def sampling(**kw) -> pb.SamplingParams:
    from engine.sampling.params import SamplingParams, to_proto

    return to_proto(SamplingParams(**kw))


def dispatch(pc, dc, prefill_address: str, request_id: str, prompt: list[int], params: pb.SamplingParams,
             transport: str = "grpc", timeout: float = 60.0):
    """Concurrent dispatch, as the router does: the Prefill call on P (channel `pc`) and the
    Generate(prefill_from=P) stream on D (channel `dc`), both started, neither awaited."""
    pre = pb_grpc.PrefillServiceStub(pc).Prefill(
        pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params), timeout=timeout)
    gen = pb_grpc.DecodeServiceStub(dc).Generate(vouched(
        pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params,
                           prefill_from=prefill_address, kv_transport=transport)), timeout=timeout)
    return pre, gen


async def disaggregated(prefill: Pod, decode: Pod, request_id: str, prompt: list[int], params: pb.SamplingParams,
                        transport: str = "grpc", timeout: float = 60.0, channel=pod_channel) -> tuple[list[int], list]:
    """`dispatch` over channels from `channel(address)`; the tokens and D's messages."""
    async with channel(prefill.address) as pc, channel(decode.address) as dc:
        pre, gen = dispatch(pc, dc, prefill.address, request_id, prompt, params, transport, timeout)
        messages = [m async for m in gen]
        first = await pre
    tokens = [t for m in messages for t in m.token_ids]
    # The first token is P's, unless D lost the pull and prefilled locally (then it is D's own).
    assert tokens and (messages[0].local_prefill or tokens[0] == first.first_token_id)
    return tokens, messages


def run(coro):
    return asyncio.run(coro)
