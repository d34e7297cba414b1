"""Changing a running `cbserve up` cluster: `cbserve scale` talks to it over a Unix socket.

    cbserve up --port 8000 &
    cbserve scale --port 8000 --decode 3        # start decode pods until there are 3
    cbserve scale --port 8000 --prefill 1 --decode 1
    cbserve scale --port 8000                   # just print the pods

An operator who runs `cbserve up` expects what `kubectl scale` does to a Deployment: name the pod
count, and the cluster gets there without dropping requests. A pod added starts, and once it is
SERVING joins the router's pods file (the router re-reads it: `router.discovery.file`). A pod
removed (the highest-numbered of its role first, as a ReplicaSet picks the newest) leaves the
pods file first, so it gets no new requests, then drains on SIGTERM (`LocalCluster.remove_pod`).

The socket is `control.sock` in a directory only its user can enter (0700), so the filesystem is
what authenticates a caller: the same user as `cbserve up`. One JSON request per connection, one
JSON answer: {"scale": {"decode": 3}} or {"status": {}} -> {"pods": [...]} or {"error": "..."}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import socketserver
import sys
import tempfile
import threading
from pathlib import Path

from cbserve.local_cluster import ClusterError, LocalCluster

MAX_MESSAGE_BYTES = 64 << 10


def default_socket_path(port: int) -> Path:
    """Where `cbserve up --port PORT` listens for `cbserve scale --port PORT`."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"cbserve-up-{port}" / "control.sock"


def _describe(cluster: LocalCluster) -> list[dict]:
    return [{"name": p.name, "role": p.role, "address": p.address, "metrics_url": p.metrics_url}
            for p in cluster.pods]


def scale(cluster: LocalCluster, counts: dict[str, int]) -> list[dict]:
    """Add or retire pods until each role in `counts` has that many; returns the pods."""
    for role, wanted in counts.items():
        if wanted < (0 if cluster.spec.colocated else 1):
            raise ClusterError(f"a cluster needs at least one {role} pod")
        current = [p for p in cluster.pods if p.role == role]
        for _ in range(wanted - len(current)):
            cluster.add_pod(role)
        for pod in sorted(current, key=lambda p: int(p.name.rpartition("-")[2]), reverse=True)[:max(0, len(current) - wanted)]:
            cluster.remove_pod(pod.name)
    return _describe(cluster)


class ControlServer:
    """Serves `scale` and `status` for `cluster` on a Unix socket at `path`, in a daemon thread.
    One command at a time: a second `scale` waits for the first."""

    def __init__(self, cluster: LocalCluster, path: Path) -> None:
        self.cluster = cluster
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        if path.exists():
            path.unlink()   # a previous `up` on this port that was killed
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(MAX_MESSAGE_BYTES)
                self.wfile.write((json.dumps(owner.answer(line)) + "\n").encode())

        self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="cbserve-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)

    def answer(self, line: bytes) -> dict:
        try:
            message = json.loads(line)
            if not isinstance(message, dict) or len(message) != 1:
                raise ValueError("send one of {\"scale\": {role: count}}, {\"status\": {}}")
            (command, body), = message.items()
            with self._lock:
                if command == "status":
                    return {"pods": _describe(self.cluster)}
                if command == "scale" and isinstance(body, dict) and all(
                        role in ("prefill", "decode", "colocated") and isinstance(n, int) for role, n in body.items()):
                    return {"pods": scale(self.cluster, body)}
            raise ValueError(f"unknown command or malformed body: {message!r}")
        except (ValueError, ClusterError) as exc:
            return {"error": str(exc)}


def send(path: Path, message: dict, timeout: float = 900.0) -> dict:
    """One request to the control socket at `path`; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall((json.dumps(message) + "\n").encode())
        return json.loads(sock.makefile("rb").readline(MAX_MESSAGE_BYTES))


def add_scale_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="change the pod counts of a running `cbserve up`", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8000, help="the router port of the `cbserve up` to change")
    p.add_argument("--socket", default=None, help="its control socket (default: from --port)")
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"{role} pods wanted")
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    path = Path(args.socket) if args.socket else default_socket_path(args.port)
    counts = {role: getattr(args, role) for role in ("prefill", "decode", "colocated")
              if getattr(args, role) is not None}
    try:
        answer = send(path, {"scale": counts} if counts else {"status": {}})
    except OSError as exc:
        print(f"error: no `cbserve up` answers at {path} ({exc.strerror or exc})", file=sys.stderr)
        return 1
    if "error" in answer:
        print(f"error: {answer['error']}", file=sys.stderr)
        return 1
    for pod in answer["pods"]:
        print(f"{pod['name']:<12} {pod['role']:<9} {pod['address']:<22} {pod['metrics_url']}")
    return 0
