"""Child processes of a local cluster: start, stream logs with a prefix, keep a tail, stop in order.

Each child runs in its own session, so a Ctrl-C in the terminal reaches only `cbserve up`, which then
stops the children in order (router first, then pods) instead of all of them dying at once mid-stream.
On Linux each child also gets PR_SET_PDEATHSIG, so a parent killed with SIGKILL leaves no orphans
(children are started from one long-lived thread: the signal follows the starting thread).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

LogSink = Callable[[str], None]
TAIL_LINES = 60
_SINK_LOCK = threading.Lock()


def stderr_sink(line: str) -> None:
    """Write one prefixed log line to stderr (lines from many children never interleave mid-line)."""
    with _SINK_LOCK:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a pod
# started from a short-lived thread (`LocalCluster.add_pod` from a `cbserve scale` handler, a
# test's helper thread) got SIGTERM, and drained away, the moment that thread ended. Every child is
# started on this one thread, which lives as long as the process.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbserve-spawner")


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. 1 = PR_SET_PDEATHSIG: the kernel sends SIGTERM when
    # the thread that started us (`_SPAWNER`'s) exits, so the child drains as on Ctrl-C even if
    # `up` was SIGKILLed.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class ManagedProcess:
    """One child process; stdout and stderr are merged and read line by line by a daemon thread."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], sink: LogSink | None = None,
                 log_file: Path | None = None, pass_fds: Sequence[int] = ()) -> None:
        """`pass_fds`: file descriptors the child inherits (the router's listening socket)."""
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.pass_fds = tuple(pass_fds)
        self.sink = sink
        self.log_file = log_file
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self, append_log: bool = False) -> None:
        """Start the process (again, after it exited: same argv and env; `append_log` keeps the
        log file's earlier lines)."""
        self._proc = _SPAWNER.submit(
            subprocess.Popen, self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None, pass_fds=self.pass_fds).result()
        log = open(self.log_file, "a" if append_log else "w", encoding="utf-8") if self.log_file else None  # noqa: SIM115 (closed by reader)
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout, log),
                                        name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes], log: IO[str] | None) -> None:
        prefix = f"[{self.name}] "
        try:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._tail.append(line)
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
                if self.sink is not None:
                    self.sink(prefix + line)
        finally:
            stream.close()
            if log is not None:
                log.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started), else the exit code (negative: killed by signal)."""
        return self._proc.poll() if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def tail(self, num_lines: int = 30) -> str:
        """The last log lines; waits briefly for the reader when the process has exited."""
        if self._reader is not None and not self.running:
            self._reader.join(timeout=2.0)
        return "\n".join(list(self._tail)[-num_lines:])

    def send(self, sig: int) -> None:
        if self.running:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        """True when the process has exited within `timeout` seconds."""
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout=max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_group(procs: Sequence[ManagedProcess], grace_seconds: float) -> list[str]:
    """SIGTERM every process, wait up to `grace_seconds` for all, SIGKILL the rest.

    Returns the names of the processes that had to be killed.
    """
    for proc in procs:
        proc.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    killed = []
    for proc in procs:
        if not proc.wait(deadline - time.monotonic()):
            proc.send(signal.SIGKILL)
            proc.wait(5.0)
            killed.append(proc.name)
    return killed


def kill_all(procs: Sequence[ManagedProcess]) -> None:
    """SIGKILL at once (a second Ctrl-C)."""
    for proc in procs:
        proc.send(signal.SIGKILL)
    for proc in procs:
        proc.wait(5.0)


def child_env(threads: int | None, extra: dict[str, str] | None = None, without: Sequence[str] = ()) -> dict[str, str]:
    """The parent's environment less `without`, unbuffered, with the thread count every pod honours."""
    env = {name: value for name, value in os.environ.items() if name not in without}
    env["PYTHONUNBUFFERED"] = "1"      # logs reach the prefixer line by line, not in 8 KiB blocks
    if threads is not None:
        for name in ("CBSERVE_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(threads)
    env.update(extra or {})
    return env
