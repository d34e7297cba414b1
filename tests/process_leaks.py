"""Finding and stopping the processes a test session started, by a mark in their environment.

The suite's conftest sets `SESSION_ENV` to a value of its own before any test runs; every child
started with a copy of `os.environ` (pods, routers, `cbserve up`, engine cores, tensor-parallel
ranks, ...) inherits it, and so do their children, wherever they were reparented. A process that
gets a hand-made environment (`buildah run --env`) is given the mark explicitly. At the end of the
session, what still carries the mark has outlived the test that started it.

Reads /proc (Linux): a process's initial environment is /proc/PID/environ, readable by its owner
and by root (the image test's processes run as uid 10001, the suite as root in CI).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

SESSION_ENV = "CBSERVE_TEST_SESSION"
# What counts as a cbserve process: `python -m cbserve.cli ...` (router, pods, `up`, engine
# cores), the image's `cbserve` entry point (and its tini and `buildah run`), tensor-parallel ranks.
CBSERVE_MARKERS = ("cbserve", "engine.tp.worker")


@dataclass(frozen=True)
class Process:
    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command[:200]}"


def marked(name: str, value: str) -> list[Process]:
    """Live processes (not zombies) whose environment has `name=value`, this one excepted."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:        # gone meanwhile, or not ours to read
            continue
        if command:            # a zombie has no command line: it is dead, only not reaped yet
            found.append(Process(int(entry.name), command))
    return found


def is_cbserve(process: Process) -> bool:
    return any(marker in process.command for marker in CBSERVE_MARKERS)


def stop(name: str, value: str, grace_seconds: float = 30.0) -> list[Process]:
    """SIGTERM every process marked `name=value`, SIGKILL what is left after `grace_seconds`.
    Returns the ones that needed SIGKILL."""
    for process in marked(name, value):
        _signal(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while marked(name, value) and time.monotonic() < deadline:
        time.sleep(0.2)
    stubborn = marked(name, value)
    for process in stubborn:
        _signal(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while marked(name, value) and time.monotonic() < deadline:
        time.sleep(0.1)
    return stubborn


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
