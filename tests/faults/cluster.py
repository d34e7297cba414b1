"""Real processes for the fault suite: pods (`tests.pods.podproc.Pod`), a router, and the checks
every fault test ends with (each pod back at its idle KV baseline).

Pods start in parallel (`start_pods`), because the suite's time goes mostly into starting
processes on two loaded cores. Every wait here has a generous deadline: a fault test asserts what
a client sees and that nothing leaks, never how fast a loaded machine is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from pod.auth import SECRET_ENV, auth_metadata
from tests.pods.podproc import ROOT, SECRET, Pod, free_port, get_load
from wire import cbserve_pb2 as pb

STARTUP_SECONDS = 180.0
IDLE_SECONDS = 60.0
# The KV-path proxy's port, chosen once per session (a module imported once: conftest is not): the
# shared pair's prefill pod advertises it, so KV handles for the proxy's address pass there.
PROXY_PORT = free_port()


def start_pods(*specs: tuple[str, ...]) -> list[Pod]:
    """Start `Pod(role, *args)` for each spec at once, then wait until all are SERVING."""
    pods = [Pod(role, *args) for role, *args in specs]
    try:
        for pod in pods:
            pod.wait_ready(STARTUP_SECONDS)
    except BaseException:
        for pod in pods:
            pod.stop()
        raise
    return pods


def load(pod: Pod) -> pb.LoadReport | None:
    """The pod's load report, None when it does not answer."""
    try:
        return pod.load()
    except grpc.RpcError:
        return None


def is_idle(report: pb.LoadReport | None) -> bool:
    """The idle KV baseline: every block free (cached ones count), nothing held, queued or running."""
    return (report is not None and report.num_free_blocks == report.num_total_blocks
            and report.num_held_kv == 0 and report.num_running == 0 and report.num_waiting == 0)


def wait_idle(pods: list[Pod], timeout: float = IDLE_SECONDS) -> float:
    """Seconds until every pod in `pods` is at its idle baseline; raises with the reports after
    `timeout`."""
    start = time.monotonic()
    while True:
        reports = {pod.address: load(pod) for pod in pods}
        if all(is_idle(r) for r in reports.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            described = {a: None if r is None else dict(free=r.num_free_blocks, total=r.num_total_blocks,
                                                         held=r.num_held_kv, running=r.num_running,
                                                         waiting=r.num_waiting) for a, r in reports.items()}
            raise AssertionError(f"pods not idle after {timeout}s: {described}")
        time.sleep(0.1)


class ClusterPod:
    """A pod of a `LocalCluster`, read like a `Pod` here (`load`, `metrics_port`): its GetLoad
    carries that cluster's secret."""

    def __init__(self, info, secret: str) -> None:
        self.name, self.role, self.address = info.name, info.role, info.address
        self.metrics_port = info.ports[1]
        self._auth = auth_metadata(secret)

    def load(self) -> pb.LoadReport:
        return get_load(self.address, self.role, self._auth)


def metric(pod: Pod, name: str) -> float:
    """Sum of a pod's Prometheus samples named exactly `name` (any labels)."""
    text = httpx.get(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5, trust_env=False).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Router:
    """`cbserve router` as a process on 127.0.0.1 in front of the given pods."""

    def __init__(self, prefill: list[Pod], decode: list[Pod], *args: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix="cbserve-router-", suffix=".log")[1])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cbserve.cli", "--log-level", "INFO", "router", "--host", "127.0.0.1",
               "--port", str(self.port), "--model", "tiny",
               "--prefill", ",".join(p.address for p in prefill), "--decode", ",".join(p.address for p in decode),
               *args]
        env = {**os.environ, "CBSERVE_NUM_THREADS": "1", SECRET_ENV: SECRET}   # the pods' secret
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = STARTUP_SECONDS) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
