"""Restarting a local cluster's processes as a kubelet restarts containers.

A child that exits while the cluster runs (crash, OOM kill, kill -9) is started again with the same
command line, so at the same address: the router's static discovery still names it, and its load
tracking re-admits it once it answers its probes. Restarts back off exponentially per process
(1 s, 2 s, 4 s, ... capped at `MAX_BACKOFF_SECONDS`, like Kubernetes' CrashLoopBackOff but
shorter), and a process that stayed up `STABLE_SECONDS` starts again from the first step. The
other processes keep serving meanwhile. `cbserve up --exit-on-failure` skips all this and stops
the whole cluster instead (for scripts that want to know).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from cbserve.processes import LogSink, ManagedProcess

INITIAL_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
STABLE_SECONDS = 60.0


def backoff_seconds(consecutive_failures: int) -> float:
    """The wait before restart number `consecutive_failures` (1-based) of a crash loop."""
    return min(MAX_BACKOFF_SECONDS, INITIAL_BACKOFF_SECONDS * 2 ** max(0, consecutive_failures - 1))


@dataclass
class _Child:
    started_at: float
    failures: int = 0                  # consecutive exits without `STABLE_SECONDS` of uptime
    restart_at: float | None = None    # set while the child is down and waiting for its restart
    restarts: int = 0


class Supervisor:
    """Watches `procs` (name -> process, all started); `poll()` restarts those that are due."""

    def __init__(self, procs: Mapping[str, ManagedProcess], sink: LogSink | None = None) -> None:
        self.procs = procs
        self.sink = sink
        now = time.monotonic()
        self._children = {name: _Child(now) for name in procs}

    def restarts(self, name: str) -> int:
        """How many times `name` was started again."""
        return self._children[name].restarts

    def poll(self, now: float | None = None) -> list[str]:
        """One pass: note exits, restart what is due. Returns the names restarted now."""
        now = time.monotonic() if now is None else now
        restarted = []
        for name, proc in list(self.procs.items()):   # pods come and go (`LocalCluster.add_pod`)
            child = self._children.setdefault(name, _Child(now))
            if proc.running:
                continue
            if child.restart_at is None:
                child.failures = 1 if now - child.started_at >= STABLE_SECONDS else child.failures + 1
                delay = backoff_seconds(child.failures)
                child.restart_at = now + delay
                self._say(f"{name} exited with code {proc.returncode}; restarting it in {delay:.0f}s. "
                          f"Last log lines:\n{proc.tail(10)}")
            elif now >= child.restart_at:
                proc.start(append_log=True)
                child.started_at, child.restart_at = now, None
                child.restarts += 1
                restarted.append(name)
                self._say(f"{name} restarted (restart {child.restarts})")
        return restarted

    def _say(self, message: str) -> None:
        if self.sink is not None:
            self.sink(f"[supervisor] {message}")
