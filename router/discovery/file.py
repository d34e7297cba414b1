"""File discovery: the pod addresses in a JSON file, which may change while the router runs.

    {"prefill": ["127.0.0.1:50051"], "decode": ["127.0.0.1:50052", "127.0.0.1:50053"]}
    {"colocated": ["10.0.0.5:50052"]}

For pods run outside Kubernetes (`cbserve up`, systemd units, hand-run processes): whoever adds a
pod writes the file with it once the pod is ready, and whoever retires one removes it first. The
router reads the file at start (it must exist and parse) and then every `poll_seconds`; each
change is published like a Kubernetes EndpointSlice change: a new address is probed and routed to
once it answers, a removed one gets no new requests while the ones on it finish (the pod drains).
Write the file atomically (a temporary file renamed over it): a file that does not parse, or names
an unknown role or a malformed address, is logged and ignored, and the last good set stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from router.discovery.base import Discovery, PodEndpoint

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "colocated")


def read_pods_file(path: str | Path) -> frozenset[PodEndpoint]:
    """The endpoints `path` lists; raises ValueError naming what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the pods file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the pods file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the pods file {path} must hold an object {{role: [HOST:PORT, ...]}}")
    unknown = set(data) - set(ROLES)
    if unknown:
        raise ValueError(f"the pods file {path} names unknown roles {sorted(unknown)} (roles: {', '.join(ROLES)})")
    endpoints = set()
    for role, addresses in data.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"the pods file {path}: {role!r} must be a list of HOST:PORT strings")
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"the pods file {path}: {role} address must be HOST:PORT, got {address!r}")
            endpoints.add(PodEndpoint(address, role, address))
    if any(e.role == "colocated" for e in endpoints) and any(e.role != "colocated" for e in endpoints):
        raise ValueError(f"the pods file {path}: list either colocated pods or prefill/decode pods, not both")
    return frozenset(endpoints)


class FileDiscovery(Discovery):
    """The endpoints in `path`, re-read when the file changes (checked every `poll_seconds`)."""

    def __init__(self, path: str | Path, poll_seconds: float = 0.5) -> None:
        super().__init__()
        self.path = Path(path)
        self.poll_seconds = poll_seconds
        self._seen: tuple[int, int, int] | None = None     # (inode, size, mtime_ns) last read
        self._task: asyncio.Task | None = None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    async def start(self) -> None:
        self._seen = self._stamp()
        self._publish(read_pods_file(self.path))            # a bad file at start fails the router
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            stamp = self._stamp()
            if stamp is None or stamp == self._seen:
                continue
            self._seen = stamp
            try:
                endpoints = read_pods_file(self.path)
            except ValueError as exc:
                log.warning("%s; keeping the %d pods read before", exc, len(self.endpoints()))
                continue
            if endpoints != self.endpoints():
                log.info("pods file %s: %s", self.path, ", ".join(sorted(f"{e.role} {e.address}" for e in endpoints)))
            self._publish(endpoints)
