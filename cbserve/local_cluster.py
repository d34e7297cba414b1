"""LocalCluster: router + prefill + decode pods (or colocated engines) as real processes on this machine.

    with LocalCluster(ClusterSpec(model="tiny", port=0)) as cluster:
        openai.OpenAI(base_url=cluster.base_url, api_key="unused").completions.create(...)

Every child is `python -m cbserve.cli <role> ...` with the same interpreter, so local behaviour is
the chart's behaviour. Pods bind loopback ports chosen free at start. The router's socket is
bound here, at `spec.port` (0: a free one), before any child starts, and the router process
serves it (`--listen-fd`): it starts first, so from the moment `start()` begins a client's
connection waits instead of being refused, and a request for which no pod is ready yet waits in
the router's queue (`--startup-wait-seconds`); a restarted router serves the same socket. Readiness is what Kubernetes probes: the standard gRPC health service on each pod,
then HTTP `/ready` on the router (which needs a ready prefill/decode pair). Pods sharing one CUDA
device start one after another: each sizes its KV cache from the memory it measures and must not
count a neighbour that is still loading (each gets an even part of `--gpu-memory-utilization`).
A child that exits during startup fails `start()` with its log tail. Once started, `supervise()`
(one pass; `supervise_in_background()` runs it in a thread) restarts a child that exits, with
backoff, at the same address (`cbserve.supervisor`); `check_alive()` instead reports it. `stop()`
drains the router first (it finishes the streams that still need the pods), then the pods, and
SIGKILLs whatever outlives the grace period.
Each cluster generates its own deployment secret and hands it to every child in the environment
($CBSERVE_CLUSTER_SECRET; never on a command line, which `ps` shows), so its pods answer only its
router and each other (`pod/auth.py`); a restarted child gets the same one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cbserve.cluster_spec import ClusterSpec
from cbserve.processes import LogSink, ManagedProcess, child_env, kill_all, stop_group
from cbserve.readiness import grpc_serving, http_ready
from cbserve.supervisor import Supervisor
from pod.auth import SECRET_ENV

__all__ = ["ClusterError", "ClusterSpec", "LocalCluster", "PodInfo"]
API_KEY_ENV = "CBSERVE_API_KEY"   # the variable the router reads by default (`--api-key-env`)
ROUTER_RELOAD_SECONDS = 1.0       # the router re-reads its pods file within this (router.discovery.file)


class ClusterError(RuntimeError):
    """The cluster could not start, or one of its processes died."""


@dataclass(frozen=True)
class PodInfo:
    name: str                 # prefill-0, decode-0, colocated-0: also the pod's --pod-id
    role: str                 # prefill | decode | colocated
    address: str              # HOST:PORT of its gRPC server
    metrics_url: str
    kv_store_port: int

    @property
    def ports(self) -> tuple[int, int, int]:
        """(gRPC, metrics, KV store) ports, as `ClusterSpec.pod_argv` takes them."""
        metrics = self.metrics_url.removeprefix("http://").partition("/")[0]
        return int(self.address.rpartition(":")[2]), int(metrics.rpartition(":")[2]), self.kv_store_port


@dataclass
class _Running:
    pods: list[PodInfo] = field(default_factory=list)
    procs: dict[str, ManagedProcess] = field(default_factory=dict)   # name -> process, start order


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pod_info(name: str, role: str, ports: Sequence[int]) -> PodInfo:
    grpc_port, metrics_port, store_port = ports
    return PodInfo(name, role, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics", store_port)


def _listen(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound here before any child starts (port 0: a free one).

    The router serves it (`--listen-fd`), so a client that connects while the router process is
    still importing, or is being restarted, waits in the backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise ClusterError(f"router port {host}:{port} is not free ({e.strerror}); pick another --port") from None


class LocalCluster:
    """Start, wait for, describe and stop a local cluster. Use as a context manager."""

    def __init__(self, spec: ClusterSpec | None = None, *, sink: LogSink | None = None,
                 log_dir: str | Path | None = None, command: Sequence[str] | None = None,
                 listener: socket.socket | None = None) -> None:
        """`sink` receives every child log line with a `[name] ` prefix (None: keep only tails and
        files); `log_dir` also writes `<name>.log` per child; `command` replaces
        `python -m cbserve.cli` (tests run stand-in processes with it); `listener` is the router's
        socket if it is bound already (`cbserve.early_listen`)."""
        self.spec = spec or ClusterSpec()
        self.sink = sink
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.command = list(command) if command else [sys.executable, "-m", "cbserve.cli"]
        self.router_port: int | None = None
        self.cluster_secret = secrets.token_urlsafe(32)   # for clients that call the pods directly
        self._run = _Running()
        self._listener: socket.socket | None = listener
        # The router's pods file (`--discovery file`), in a directory made at start: `add_pod` and
        # `remove_pod` rewrite it.
        self._state_dir: Path | None = None
        self.pods_file: Path | None = None
        self._lock = threading.Lock()    # the pod set, against the supervisor thread
        self._next_index: dict[str, int] = {}
        self._supervisor: Supervisor | None = None
        self._supervising: threading.Thread | None = None
        self._stop_supervising = threading.Event()

    # -- addresses ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The router's base URL, e.g. http://127.0.0.1:8000."""
        if self.router_port is None:
            raise ClusterError("cluster is not started")
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host
        return f"http://{host}:{self.router_port}"

    @property
    def base_url(self) -> str:
        """The OpenAI client's base URL (`url` + /v1)."""
        return self.url + "/v1"

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def pods(self) -> list[PodInfo]:
        return list(self._run.pods)

    @property
    def processes(self) -> dict[str, ManagedProcess]:
        return dict(self._run.procs)

    # -- life cycle ---------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        """Start every process and wait until all are ready; on any failure stop what was started."""
        if self._run.procs:
            raise ClusterError("cluster already started")
        spec = self.spec
        if self._listener is None:
            self._listener = _listen(spec.host, spec.port)
        self.router_port = self._listener.getsockname()[1]
        self._state_dir = Path(tempfile.mkdtemp(prefix="cbserve-up-"))
        self.pods_file = self._state_dir / "pods.json"
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        roles = spec.pod_roles()
        ports = free_ports(3 * len(roles))
        deadline = time.monotonic() + spec.startup_timeout
        for i, (name, role) in enumerate(roles):
            self._run.pods.append(_pod_info(name, role, ports[3 * i:3 * i + 3]))
            self._next_index[role] = self._next_index.get(role, 0) + 1
        self._write_pods_file()
        try:
            # The router first: it answers (and queues requests for the pods, `--startup-wait-seconds`)
            # while the pods load.
            fd = self._listener.fileno()
            self._spawn("router", [*spec.router_argv(self.router_port, self._addresses(), str(self.pods_file)),
                                   "--listen-fd", str(fd)], pass_fds=(fd,))
            for pod in self._run.pods:
                self._spawn(pod.name, spec.pod_argv(pod.name, pod.role, *pod.ports))
                if spec.shares_cuda_device:
                    self._wait_pods([pod], deadline, spec.startup_timeout)
            self._wait_pods(self._run.pods, deadline, spec.startup_timeout, router=True)
        except BaseException:
            self.stop()
            raise
        return self

    def _addresses(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for pod in self._run.pods:
            out[pod.role].append(pod.address)
        return out

    def _write_pods_file(self) -> None:
        """The router's view of the pod set, replaced atomically (it re-reads it when it changes)."""
        tmp = self.pods_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({role: a for role, a in self._addresses().items() if a}, indent=1) + "\n")
        os.replace(tmp, self.pods_file)

    # -- changing the pod set while it serves ----------------------------------------------------------
    def add_pod(self, role: str, timeout: float | None = None) -> PodInfo:
        """Start one more pod of `role` (prefill or decode; colocated in a colocated cluster), wait
        until it is SERVING, then list it for the router, as a Kubernetes Service lists a ready pod.
        Supervision restarts it like the others. Raises ClusterError if it does not get ready."""
        expected = ("colocated",) if self.spec.colocated else ("prefill", "decode")
        if role not in expected:
            raise ClusterError(f"this cluster runs {' and '.join(expected)} pods, not {role}")
        with self._lock:
            index = self._next_index.get(role, 0)
            self._next_index[role] = index + 1
            pod = _pod_info(f"{role}-{index}", role, free_ports(3))
            self._spawn(pod.name, self.spec.pod_argv(pod.name, role, *pod.ports))
        timeout = self.spec.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not grpc_serving(pod.address, timeout=0.5):
            proc = self._run.procs.get(pod.name)
            if time.monotonic() > deadline or proc is None or proc.returncode is not None:
                tail = proc.tail(20) if proc is not None else ""
                self.remove_pod(pod.name, grace_seconds=5.0)
                raise ClusterError(f"{pod.name} did not get ready within {timeout:.0f}s; last log lines:\n{tail}")
            time.sleep(0.2)
        with self._lock:
            self._run.pods.append(pod)
            self._write_pods_file()
        return pod

    def remove_pod(self, name: str, grace_seconds: float | None = None) -> bool:
        """Retire the pod `name` as a rolling update does: out of the router's pods file first (no
        new requests; the ones on it finish), then SIGTERM (it drains), SIGKILL after the grace
        period. Supervision no longer restarts it. Returns whether it had to be killed."""
        with self._lock:
            proc = self._run.procs.pop(name, None)
            if proc is None or name == "router":
                if proc is not None:
                    self._run.procs[name] = proc
                raise ClusterError(f"no pod named {name!r}")
            listed = [p for p in self._run.pods if p.name != name]
            if len(listed) != len(self._run.pods):
                self._run.pods = listed
                self._write_pods_file()
        time.sleep(ROUTER_RELOAD_SECONDS)     # the router has re-read its pods file
        grace = self.spec.drain_seconds + 5.0 if grace_seconds is None else grace_seconds
        return bool(stop_group([proc], grace))

    def _spawn(self, name: str, args: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        log_file = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        # Pods never check the API key, so they never get it; the router gets `spec.api_key`, or
        # the key this process was given in the environment. Every child gets the cluster secret.
        secret = {SECRET_ENV: self.cluster_secret}
        if name == "router":
            env = child_env(self.spec.threads_per_pod,
                            {**secret, API_KEY_ENV: self.spec.api_key} if self.spec.api_key else secret)
        else:
            env = child_env(self.spec.threads_per_pod, secret, without=[API_KEY_ENV])
        proc = ManagedProcess(name, [*self.command, *args], env, self.sink, log_file, pass_fds)
        self._run.procs[name] = proc
        proc.start()

    def wait_ready(self, timeout: float) -> None:
        """Block until every pod's gRPC health says SERVING and the router's /ready is 200."""
        self._wait_pods(self._run.pods, time.monotonic() + timeout, timeout, router=True)

    def _wait_pods(self, pods: list[PodInfo], deadline: float, timeout: float, router: bool = False) -> None:
        """Block until `pods` say SERVING (and, with `router`, the router's /ready is 200) or
        raise at `deadline` (`timeout`: for the message)."""
        pending = {pod.name: pod for pod in pods}
        while True:
            self.check_alive("during startup")
            for name, pod in list(pending.items()):
                if grpc_serving(pod.address, timeout=0.5):
                    del pending[name]
            if not pending and (not router or http_ready(self.url + "/ready", timeout=1.0)):
                return
            if time.monotonic() > deadline:
                waiting = ", ".join(pending) or "router (/ready)"
                tails = "\n".join(f"--- {n} ---\n{self._run.procs[n].tail(10)}" for n in (list(pending) or ["router"]))
                raise ClusterError(f"not ready after {timeout:.0f}s: {waiting}\n{tails}")
            time.sleep(0.2)

    def check_alive(self, when: str = "") -> None:
        """Raise ClusterError with the log tail of the first child that has exited."""
        for proc in self._run.procs.values():
            code = proc.returncode
            if code is not None:
                raise ClusterError(f"{proc.name} exited with code {code} {when}".rstrip()
                                   + f"; last log lines:\n{proc.tail()}")

    def supervise(self) -> list[str]:
        """One supervision pass: restart the children that exited and whose backoff has passed
        (`cbserve.supervisor`). Returns the names restarted now."""
        with self._lock:
            if self._supervisor is None:
                self._supervisor = Supervisor(self._run.procs, self.sink)
            return self._supervisor.poll()

    def restarts(self, name: str) -> int:
        """How many times the child `name` was restarted by supervision."""
        return self._supervisor.restarts(name) if self._supervisor is not None else 0

    def supervise_in_background(self, interval: float = 0.5) -> None:
        """Run `supervise()` every `interval` seconds in a daemon thread until `stop()`."""
        def loop() -> None:
            while not self._stop_supervising.wait(interval):
                self.supervise()
        self.supervise()
        self._supervising = threading.Thread(target=loop, name="cluster-supervisor", daemon=True)
        self._supervising.start()

    def stop(self, grace_seconds: float | None = None) -> list[str]:
        """Drain the router, then the pods; SIGKILL what outlives the grace period. Returns killed names."""
        self._stop_supervising.set()      # nothing restarts what is being stopped
        if self._supervising is not None:
            self._supervising.join()
        grace = self.spec.drain_seconds + 5.0 if grace_seconds is None else grace_seconds
        procs = self._run.procs
        router = [procs["router"]] if "router" in procs else []
        pods = [p for name, p in procs.items() if name != "router"]
        try:
            killed = stop_group(router, grace)
            self._close_listener()        # nothing serves it any more: refuse, do not queue
            killed += stop_group(pods, grace)
        except KeyboardInterrupt:   # a second Ctrl-C: stop waiting
            kill_all(list(procs.values()))
            raise
        finally:
            self._close_listener()
            if self._state_dir is not None:
                shutil.rmtree(self._state_dir, ignore_errors=True)
        return killed

    def kill(self) -> None:
        """SIGKILL every child now."""
        kill_all(list(self._run.procs.values()))
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
