"""A stand-in for `cbserve prefill|decode|router`, so LocalCluster's process handling is tested alone.

Pods serve the standard gRPC health service (SERVING after FAKE_READY_DELAY seconds) and a plain
/metrics; the router serves /ready (200 once every pod it was given answers SERVING), on the
socket LocalCluster bound for it (`--listen-fd`). Knobs, by env:
FAKE_FAIL=<name> exits 3 at start; FAKE_IGNORE_SIGTERM=<name> makes that process a straggler;
FAKE_RECORD_DIR writes each process's argv, thread env and API key env to <dir>/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("command", choices=["prefill", "decode", "router"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--pod-id", default="router")
    p.add_argument("--listen-fd", type=int, default=None)
    for flag in ("--prefill", "--decode"):
        p.add_argument(flag, default="")
    args, _ = p.parse_known_args(argv)
    return args


def serve_http(port: int, routes: dict, listen_fd: int | None = None) -> ThreadingHTTPServer:
    """Serve `routes` on 127.0.0.1:`port`, or on the inherited listening socket `listen_fd`."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path, lambda: (404, b"not found"))()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    if listen_fd is None:
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    else:   # as `cbserve router --listen-fd`: LocalCluster bound it
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = socket.socket(fileno=listen_fd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pod_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    argv = sys.argv[1:]
    args = parse(argv)
    name = args.pod_id
    if os.environ.get("FAKE_RECORD_DIR"):
        record = {"argv": argv, "threads": os.environ.get("CBSERVE_NUM_THREADS"),
                  "api_key": os.environ.get("CBSERVE_API_KEY")}
        Path(os.environ["FAKE_RECORD_DIR"], f"{name}.json").write_text(json.dumps(record))
    print(f"{name} starting", flush=True)
    if os.environ.get("FAKE_FAIL") == name:
        print(f"{name}: boom, cannot load model", flush=True)
        sys.exit(3)
    stopping = threading.Event()
    if os.environ.get("FAKE_IGNORE_SIGTERM") == name:
        signal.signal(signal.SIGTERM, lambda *_: print(f"{name} ignoring SIGTERM", flush=True))
    else:
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    if args.command == "router":
        # "--colocated" is a value flag on the router but a switch on pods: read it by hand.
        colocated = argv[argv.index("--colocated") + 1] if "--colocated" in argv else ""
        pods = [a for a in ",".join([args.prefill, args.decode, colocated]).split(",") if a]
        if "--pods-file" in argv:   # --discovery file, as LocalCluster starts it: read at every probe
            pods_file = Path(argv[argv.index("--pods-file") + 1])
            listed = lambda: [a for addresses in json.loads(pods_file.read_text()).values() for a in addresses]  # noqa: E731
        else:
            listed = lambda: pods  # noqa: E731
        ready = lambda: (200, b"ready") if (now := listed()) and all(map(pod_serving, now)) else (503, b"not ready")  # noqa: E731
        serve_http(args.port, {"/ready": ready, "/health": lambda: (200, b"ok")}, args.listen_fd)
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # the servicer starts SERVING for ""
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{args.port}")
        server.start()
        time.sleep(float(os.environ.get("FAKE_READY_DELAY", "0")))
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        if args.metrics_port:
            serve_http(args.metrics_port, {"/metrics": lambda: (200, b"cbserve_preemptions_total 0\n")})
    print(f"{name} ready", flush=True)
    while not stopping.wait(0.1):
        pass
    print(f"{name} drained", flush=True)


if __name__ == "__main__":
    main()
