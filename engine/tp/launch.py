"""Rank 0 of a tensor-parallel engine: spawns the other ranks, drives their steps, watches them.

The pod (or `cbserve generate`) process is rank 0: it creates the rendezvous store, starts ranks
1..N-1 as `python -m engine.tp.worker` subprocesses (their settings travel as JSON in an environment
variable: no pickled closures), and joins the group with them. The store is a file (torch's
`FileStore`) in a directory only this user can open (`tempfile.mkdtemp`, mode 0700), removed when
the group closes: all ranks run on one machine, so the rendezvous needs no listener, and a store
that nobody can connect to needs no authentication (a TCPStore accepts any local caller). It alone
schedules; `TPDriver.step` sends each step's inputs to the others before rank 0's forward.

Failure: a rank that dies must not leave the pod hanging in a collective. A watchdog thread polls
the subprocesses; when one exits unexpectedly it logs which rank and why, runs the `on_lost`
hooks (the pod turns NOT_SERVING) and ends this process with `EXIT_RANK_LOST`, after killing the
other ranks. Hangs without a death (a stuck device) end at the collective timeout, and any error
on rank 0 inside a step ends the process the same way: the others are left in a collective rank 0
will never join, and the group cannot resynchronise. While rank 0
is idle, a heartbeat message every `HEARTBEAT_SECONDS` keeps the other ranks' waits (which time
out like any collective) from expiring; workers exit on their own when rank 0 disappears.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from engine.tp.comm import CMD_HEARTBEAT, CMD_STEP, CMD_STOP, TPComm
from engine.tp.worker import SPEC_ENV, WorkerSpec

log = logging.getLogger(__name__)

EXIT_RANK_LOST = 3
HEARTBEAT_SECONDS = 5.0
WATCHDOG_POLL_SECONDS = 0.2
# Every collective, the rendezvous included, gives up after this long. It must cover the slowest
# rank's load + KV sizing (they run in parallel) and its slowest step; deaths are caught sooner.
DEFAULT_TIMEOUT_SECONDS = float(os.environ.get("CBSERVE_TP_TIMEOUT_SECONDS", "300"))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: CUDA ranks take consecutive GPUs from the configured one; CPU stays CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPDriver:
    """Rank 0's handle on the group: `comm` for the model, `step` for the runner, `close`."""

    def __init__(self, comm: TPComm, procs: list[subprocess.Popen], store_dir: str) -> None:
        self.comm = comm
        self.procs = procs
        self.store_dir = store_dir   # the rendezvous store's directory, removed by `close`
        self.on_lost: list[Callable[[str], None]] = []
        self._lock = threading.Lock()          # one message at a time: a step, or a heartbeat
        self._last_sent = time.monotonic()
        self._closing = threading.Event()
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    @classmethod
    def launch(cls, base: WorkerSpec, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_SECONDS) -> TPDriver:
        """Start ranks 1..N-1 from `base` (its rank fields are filled here) and join them."""
        size = base.size
        store_dir = tempfile.mkdtemp(prefix="cbserve-tp-")   # 0700: this user's processes only
        store_path = os.path.join(store_dir, "store")
        procs = []
        for rank in range(1, size):
            spec = base.with_rank(rank, str(rank_device(device, rank)), store_path, timeout_s)
            env = dict(os.environ, **{SPEC_ENV: spec.to_json()})
            # stdout belongs to rank 0 (`cbserve generate` prints the text there): workers log to
            # stderr. Their own session: signals to the pod's process group (Ctrl-C, `kill -- -pgid`)
            # reach rank 0 alone, which drains and then stops them; they follow rank 0's exit.
            procs.append(subprocess.Popen([sys.executable, "-m", "engine.tp.worker"], env=env,
                                          stdout=sys.stderr.fileno(), start_new_session=True))
            log.info("tensor-parallel rank %d/%d started (pid %d)", rank, size, procs[-1].pid)
        watchdog = _Watchdog(procs, store_dir)
        watchdog.start()                      # a rank that fails to load ends us, not a hang
        try:   # the group may use the store for as long as it lives (NCCL joins on first use)
            comm = TPComm.init(0, size, device, dist.FileStore(store_path, size), timeout_s)
        except BaseException:
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        driver = cls(comm, procs, store_dir)
        watchdog.driver = driver
        atexit.register(driver.close)
        return driver

    @contextlib.contextmanager
    def step(self, inputs, layout):
        """Around rank 0's forward: send the step (header, then the staged bytes) to every rank;
        the lock keeps a heartbeat from slipping between the step's collectives."""
        with self._lock, self._fatal("step"):
            self.comm.send_header(CMD_STEP, layout)
            self.comm.broadcast_bytes(inputs.device_buf[:layout.nbytes])
            yield
            self._last_sent = time.monotonic()

    @contextlib.contextmanager
    def exclusive(self, command: int, count: int):
        """Between steps (any thread): announce a KV command over `count` blocks; the caller runs
        its collectives inside (`engine.tp.kv`)."""
        with self._lock, self._fatal("KV transfer"):
            self.comm.send_header(command, count=count)
            yield self.comm
            self._last_sent = time.monotonic()

    @contextlib.contextmanager
    def _fatal(self, what: str):
        # Once a header is out, every rank runs the whole message's collectives. An error on rank 0
        # in the middle (a collective timeout, a closed peer, any exception) leaves the others
        # waiting in a collective rank 0 will never join: the group cannot recover, so end it.
        try:
            yield
        except Exception as e:
            # A peer's death often surfaces here first (closed socket): name the dead rank if so.
            self.lost(_exited(self.procs, wait_s=1.0) or
                      f"tensor-parallel {what} failed on rank 0 ({type(e).__name__}: {e}); the ranks are out of step")
            raise

    def _heartbeat(self) -> None:
        while not self._closing.wait(HEARTBEAT_SECONDS / 5):
            if time.monotonic() - self._last_sent < HEARTBEAT_SECONDS or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closing.is_set():
                    self.comm.send_header(CMD_HEARTBEAT)
                    self._last_sent = time.monotonic()
            except Exception:  # noqa: BLE001 - a lost rank: the watchdog reports it
                log.debug("tensor-parallel heartbeat failed", exc_info=True)
            finally:
                self._lock.release()

    def lost(self, message: str) -> None:
        """A rank is gone: tell the hooks, stop the others, end this process."""
        if self._closing.is_set():
            return
        log.critical("%s; the engine cannot run without every rank: exiting", message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        for hook in self.on_lost:
            with contextlib.suppress(Exception):
                hook(message)
        _kill(self.procs)
        shutil.rmtree(self.store_dir, ignore_errors=True)
        os._exit(EXIT_RANK_LOST)

    def close(self) -> None:
        """Stop every rank (idempotent): a STOP message if the group still answers, then wait."""
        if self._closing.is_set():
            return
        self._closing.set()
        log.info("stopping %d tensor-parallel ranks", len(self.procs))
        if self._lock.acquire(timeout=5.0):
            try:
                self.comm.send_header(CMD_STOP)
            except Exception:  # noqa: BLE001 - the ranks are stopped below either way
                pass
            finally:
                self._lock.release()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        _kill(self.procs)
        log.info("tensor-parallel ranks stopped")
        self.comm.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)


class _Watchdog(threading.Thread):
    """Polls the rank subprocesses; the first unexpected exit ends rank 0 (`TPDriver.lost`)."""

    def __init__(self, procs: list[subprocess.Popen], store_dir: str) -> None:
        super().__init__(name="tp-watchdog", daemon=True)
        self.procs = procs
        self.store_dir = store_dir
        self.driver: TPDriver | None = None

    def run(self) -> None:
        while True:
            message = _exited(self.procs)
            if message is not None:
                driver = self.driver
                if driver is not None and driver._closing.is_set():
                    return
                if driver is not None:
                    driver.lost(message)
                else:   # still joining the group: nobody to tell but the log
                    log.critical("%s while starting; exiting", message)
                    print(f"error: {message} while starting", file=sys.stderr, flush=True)
                    _kill(self.procs)
                    shutil.rmtree(self.store_dir, ignore_errors=True)
                    os._exit(EXIT_RANK_LOST)
            time.sleep(WATCHDOG_POLL_SECONDS)


def _exited(procs: list[subprocess.Popen], wait_s: float = 0.0) -> str | None:
    """'tensor-parallel rank r (pid p) killed by signal 9' for the first rank that has exited
    (polling up to `wait_s`), else None."""
    deadline = time.monotonic() + wait_s
    while True:
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
