"""A loopback HTTP server speaking the slice of the Kubernetes API that discovery uses.

`GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=SVC`
lists EndpointSlices; with `watch=true` it streams chunked JSON events (ADDED / MODIFIED / DELETED)
newer than `resourceVersion`, until `timeoutSeconds` or shutdown. Tests change slices with
`put_slice` / `delete_slice` while the router watches.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint(ip: str, name: str, ready: bool | None = True, terminating: bool = False) -> dict:
    conditions = {"terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": name}}


class FakeKubeAPI:
    def __init__(self, namespace: str = "serving") -> None:
        self.namespace = namespace
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.resource_version = 1
        self.requests: list[str] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._expire_before = 0          # watches from an older resourceVersion get 410 Gone
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeKubeAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def put_slice(self, service: str, name: str, port: int, endpoints: list[dict], port_name: str = "grpc") -> None:
        with self._cond:
            self.resource_version += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                   "metadata": {"name": name, "namespace": self.namespace,
                                "resourceVersion": str(self.resource_version), "labels": {SERVICE_LABEL: service}},
                   "endpoints": endpoints, "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}
            self.slices[name] = obj
            self.events.append((self.resource_version, kind, obj))
            self._cond.notify_all()

    def delete_slice(self, name: str) -> None:
        with self._cond:
            self.resource_version += 1
            obj = self.slices.pop(name)
            self.events.append((self.resource_version, "DELETED", obj))
            self._cond.notify_all()

    def expire_history(self) -> None:
        """Compact history, as etcd does: open and new watches from older versions get 410 Gone."""
        with self._cond:
            self._expire_before = self.resource_version + 1
            self._cond.notify_all()

    def _matching(self, query: dict) -> str | None:
        selector = query.get("labelSelector", [""])[0]
        key, _, value = selector.partition("=")
        return value if key == SERVICE_LABEL else None

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                api.requests.append(self.path)
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices":
                    self._json(404, {"kind": "Status", "code": 404, "message": "not found"})
                    return
                service = api._matching(query)
                if query.get("watch", ["false"])[0] == "true":
                    self._watch(service, int(query.get("resourceVersion", ["0"])[0] or 0),
                                float(query.get("timeoutSeconds", ["30"])[0]))
                    return
                with api._cond:
                    items = [s for s in api.slices.values() if s["metadata"]["labels"][SERVICE_LABEL] == service]
                    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(api.resource_version)}, "items": items}
                self._json(200, body)

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, service: str, since: int, timeout: float) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + timeout
                sent = since
                try:
                    while time.monotonic() < deadline:
                        with api._cond:
                            if api._stopping:
                                break
                            if sent < api._expire_before:
                                gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                                                                    "status": "Failure", "reason": "Expired",
                                                                    "code": 410, "message": "too old resource version"}}
                                line = json.dumps(gone).encode() + b"\n"
                                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                                break
                            pending = [(rv, kind, obj) for rv, kind, obj in api.events if rv > sent
                                       and obj["metadata"]["labels"][SERVICE_LABEL] == service]
                            if not pending:
                                api._cond.wait(0.1)
                                continue
                        for rv, kind, obj in pending:
                            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                            sent = rv
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler
