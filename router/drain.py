"""Graceful drain for the router process: SIGTERM -> not ready at once -> finish streams -> exit.

uvicorn's own shutdown stops accepting and closes idle connections right away. The router instead
keeps serving while it drains: `/ready` answers 503 from the first signal (so Kubernetes stops
sending traffic), requests in flight run to completion, and the process exits when none is left or
`drain_seconds` after the signal, whichever comes first. A second signal exits at once.
"""

from __future__ import annotations

import logging
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from router.config import RouterConfig

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal starts a drain instead of a shutdown.

    `handover`: the listening socket is shared with whoever starts our successor (`--listen-fd`:
    `cbserve up` holds it and its supervisor restarts us on it). Then the drain also stops
    accepting at once: new connections wait in the socket's backlog for the successor, instead of
    being taken by a process about to exit, and the drain ends as soon as the requests it already
    has are done. Without it (a Kubernetes pod), it keeps accepting while the endpoint removal
    that /ready's 503 starts reaches the load balancers."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_seconds: float, handover: bool = False) -> None:
        super().__init__(config)
        self.app = app
        self.drain_seconds = drain_seconds
        self.handover = handover
        self.drain_started: float | None = None

    def start_drain(self) -> None:
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            serving = getattr(self.app.state, "serving", None)
            if serving is not None:
                serving.draining = True
            if self.handover:
                for server in getattr(self, "servers", []):
                    server.close()       # our copy of the socket; the successor's stays open
            log.info("draining: /ready is 503%s; waiting up to %.0fs for in-flight requests",
                     ", no new connections (the next router takes them)" if self.handover else "",
                     self.drain_seconds)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is not None:
            self.force_exit = True
            self.should_exit = True
            return
        self.start_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None:
            elapsed = time.monotonic() - self.drain_started
            if not self.server_state.tasks or elapsed >= self.drain_seconds:
                if self.server_state.tasks:
                    log.warning("drain window (%.0fs) over with %d requests still running: they are cut off",
                                self.drain_seconds, len(self.server_state.tasks))
                self.config.timeout_graceful_shutdown = max(0.1, self.drain_seconds - elapsed)
                return True
        return await super().on_tick(counter)


def serve_with_drain(app: FastAPI, config: RouterConfig) -> None:
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                           timeout_keep_alive=30), app, config.drain_seconds,
                            handover=config.listen_fd is not None)
    if config.listen_fd is None:
        server.run()
        return
    # The parent bound and listens on it; connections made before we got here wait in its backlog.
    server.run(sockets=[socket.socket(fileno=config.listen_fd)])
