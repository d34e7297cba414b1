"""The process-group transport (`--kv-transport nccl`): KV bytes over a two-rank group per
prefill/decode pair, with `PullKV` as the control plane.

Setup (on demand, once per pair; the wire contract sends the store address decode -> prefill):
the decode pod hosts a `TCPStore` (`host_store`), calls `SetupTransport(group, store_host,
store_port, backend)` on the prefill pod and at the same time joins as rank 1; the prefill pod's
handler connects to the store (`connect_store`) and joins as rank 0. Both calls of
`PairGroup.create` return once the pair is connected. Groups live under their own `PrefixStore`
prefix, so one store and one process can carry many independent pairs; no
`init_process_group` (global state) is involved.

Framing: rank 0 only sends, rank 1 only receives. Each run travels as a small int64 header
`[kind, request_key, first_block_index, num_bytes]` followed by the run's bytes (uint8). A thread
per group does the blocking work: the sender thread sends queued frames in order and a heartbeat
when idle; the receiver thread receives headers forever and hands each payload to whoever awaits
`(request, first_block_index)` (or keeps it until they ask). Because the receiver drains every
frame, concurrent requests on one pair never need to agree on an order (NCCL matches sends and
receives by order only, not by tag), and a cancelled request's late runs are dropped instead of
wedging the group. Heartbeats keep an idle receive from timing out; a dead peer shows as an error
of the pending send/receive (at once on a closed connection, after `timeout_s` on a silent one),
which breaks the group: every waiter gets `SourceLostError`, and the pods set up a new group.

Every listener binds where the pod is told: the store on the pod's `--host` (`host_store` has no
default), Gloo on `bind_host` (the pod's `--host` unless that is a wildcard), else on the interface
named by `GLOO_SOCKET_IFNAME`, else on the address the host name resolves to (the pod IP in
Kubernetes). NCCL picks its interface from `NCCL_SOCKET_IFNAME`. On CUDA (NCCL) the
payload stays on the device end to end; the caller must make sure the KV it
sends is computed (the prefill pod reports progress after the step's forward pass). NCCL keeps
a receive kernel posted while idle; that is the price of a ready pair.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hashlib
import os
import queue
import socket
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist

from kvtransfer.errors import LayoutError, SourceLostError

_DATA, _HEARTBEAT, _CLOSE = 0, 1, 2
_FORGOTTEN_KEYS_KEPT = 4096


def request_key(request_id: str) -> int:
    """63-bit key of a request id, as carried in frame headers."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def host_store(host: str, port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """Start a store server on `host` (the pod's bind address; port 0 = any free port: read
    `store.port`) for the pairs of a pod.

    TCPStore's own listener binds every interface whatever `host_name` says, so the store gets a
    socket already bound to `host` (`master_listen_fd`; the store owns it from then on)."""
    bind = host.strip("[]") or "0.0.0.0"
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(bind, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """Connect to a peer's store (the address from `SetupTransportRequest`)."""
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def gloo_bind_host(host: str) -> str | None:
    """The address Gloo should bind for a pod bound to `host`; None for a wildcard (Gloo then
    uses GLOO_SOCKET_IFNAME or the host name's address)."""
    return None if host in ("", "0.0.0.0", "::", "[::]") else host


def _new_process_group(store: dist.Store, group_name: str, rank: int, backend: str,
                       timeout: datetime.timedelta, bind_host: str | None = None) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(f"cbserve-kv/{group_name}", store)
    if backend == "gloo":
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        if not interface and not bind_host:  # Gloo binds to the address the host name resolves to
            return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
                  else dist.ProcessGroupGloo.create_device(hostname=bind_host))
        options._devices = [device]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


class PairGroup:
    """One prefill (rank 0, sender) / decode (rank 1, receiver) pair. Use `create`."""

    def __init__(self, process_group: dist.ProcessGroup, group_name: str, rank: int,
                 device: torch.device, timeout_s: float, heartbeat_s: float) -> None:
        self.process_group = process_group
        self.group_name = group_name
        self.rank = rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.heartbeat_s = heartbeat_s
        self.broken: str | None = None  # why the group is unusable, once it is
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._waiting: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._arrived: dict[tuple[int, int], torch.Tensor] = {}
        self._forgotten: OrderedDict[int, None] = OrderedDict()
        loop = self._send_loop if rank == 0 else self._recv_loop
        self._thread = threading.Thread(target=loop, name=f"kv-pair-{group_name}-r{rank}",
                                        daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, store: dist.Store, group_name: str, rank: int, backend: str = "gloo", *,
                     device: torch.device | str = "cpu", timeout_s: float = 30.0,
                     setup_timeout_s: float = 60.0, heartbeat_s: float | None = None,
                     bind_host: str | None = None) -> PairGroup:
        """Join the pair `group_name` as `rank` (0 = prefill, 1 = decode); returns when both ranks
        are connected, or raises `SourceLostError` after `setup_timeout_s`. `timeout_s` bounds
        every send/receive (a silent peer is declared lost after it); heartbeats go out every
        `heartbeat_s` (default `timeout_s / 4`) while idle. Gloo listens on `bind_host` when
        given (`gloo_bind_host`)."""
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (prefill) or 1 (decode), got {rank}")
        device = torch.device(device)
        if (backend == "nccl") != (device.type == "cuda"):
            raise ValueError(f"backend {backend!r} does not move tensors on {device}: "
                             "use nccl with CUDA, gloo with the CPU")
        if heartbeat_s is not None and heartbeat_s >= timeout_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be below timeout_s ({timeout_s})")
        setup_timeout = datetime.timedelta(seconds=setup_timeout_s)
        try:
            process_group = await asyncio.to_thread(
                _new_process_group, store, group_name, rank, backend, setup_timeout, bind_host)
        except (RuntimeError, dist.DistError) as error:
            raise SourceLostError(f"pair {group_name}: setup failed: {error}") from error
        return cls(process_group, group_name, rank, device, timeout_s,
                   heartbeat_s if heartbeat_s is not None else timeout_s / 4)

    # ------------------------------------------------------------------ sender (rank 0)

    def submit_send(self, request_id: str, first_block_index: int,
                    tensor: torch.Tensor) -> concurrent.futures.Future:
        """Queue one run (a contiguous tensor, any dtype) for sending; frames go out in the order
        they were queued. The future completes when the bytes are sent; keep `tensor` alive and
        unchanged until then."""
        self._require_rank(0)
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.broken:
            future.set_exception(SourceLostError(f"pair {self.group_name} is broken: {self.broken}"))
            return future
        payload = tensor.reshape(-1).view(torch.uint8)  # [num_bytes], no copy
        header = [_DATA, request_key(request_id), first_block_index, payload.numel()]
        self._outbox.put((header, payload, future))
        return future

    async def send_run(self, request_id: str, first_block_index: int, tensor: torch.Tensor) -> None:
        """`submit_send` and wait for it without blocking the event loop."""
        await asyncio.wrap_future(self.submit_send(request_id, first_block_index, tensor))

    def _send_loop(self) -> None:
        while True:
            try:
                header, payload, future = self._outbox.get(timeout=self.heartbeat_s)
            except queue.Empty:
                header, payload, future = [_HEARTBEAT, 0, 0, 0], None, None
            try:
                self._send_frame(header, payload)
            except Exception as error:  # noqa: BLE001 - any failure breaks the pair
                self._break(f"send failed: {error}")
                if future is not None:
                    _settle(future, error=SourceLostError(f"pair {self.group_name}: {self.broken}"))
                self._fail_outbox()
                return
            if future is not None:
                _settle(future, None)
            if header[0] == _CLOSE:
                return

    def _send_frame(self, header: list[int], payload: torch.Tensor | None) -> None:
        header_tensor = torch.tensor(header, dtype=torch.int64, device=self.device)
        self.process_group.send([header_tensor], 1, 0).wait(self.timeout)
        if payload is not None and payload.numel():
            self.process_group.send([payload], 1, 0).wait(self.timeout)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _fail_outbox(self) -> None:
        while True:
            try:
                _, _, future = self._outbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                _settle(future, error=SourceLostError(f"pair {self.group_name}: {self.broken}"))

    # ---------------------------------------------------------------- receiver (rank 1)

    async def recv_run(self, request_id: str, first_block_index: int, num_bytes: int) -> torch.Tensor:
        """The bytes of one run, `[num_bytes]` uint8 on the group's device. Raises
        `SourceLostError` when the group breaks, `LayoutError` when the size differs."""
        self._require_rank(1)
        key = (request_key(request_id), first_block_index)
        with self._lock:
            # Runs that arrived before the group closed or broke are still good.
            payload = self._arrived.pop(key, None)
            if payload is None:
                if self.broken:
                    raise SourceLostError(f"pair {self.group_name} is broken: {self.broken}")
                future = self._waiting[key] = concurrent.futures.Future()
        try:
            if payload is None:
                payload = await asyncio.wrap_future(future)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        if payload.numel() != num_bytes:
            raise LayoutError(f"pair {self.group_name}: run {first_block_index} of {request_id} "
                             f"has {payload.numel()} bytes, expected {num_bytes}")
        return payload

    def expect(self, request_id: str) -> None:
        """A stream for `request_id` is about to start: accept its runs again, even if an earlier
        stream of the same id was forgotten (a retried pull)."""
        if self.rank != 1:
            return
        with self._lock:
            self._forgotten.pop(request_key(request_id), None)

    def forget(self, request_id: str) -> None:
        """The request is done or gone here: drop its runs that arrived unclaimed and any that
        still come (the source may have queued them before it saw the cancellation)."""
        if self.rank != 1:
            return
        key = request_key(request_id)
        with self._lock:
            for stale in [k for k in self._arrived if k[0] == key]:
                del self._arrived[stale]
            self._forgotten[key] = None
            while len(self._forgotten) > _FORGOTTEN_KEYS_KEPT:
                self._forgotten.popitem(last=False)

    def _recv_loop(self) -> None:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        try:
            while True:
                # Heartbeats arrive every heartbeat_s, so this wait only times out on a hung peer.
                self.process_group.recv([header], 0, 0).wait(self.timeout)
                kind, key, first_block_index, num_bytes = header.tolist()
                if self.broken:  # closed on this side: stop receiving
                    return
                if kind == _CLOSE:
                    self._break("closed by the sender")
                    return
                if kind != _DATA:
                    continue
                payload = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
                if num_bytes:
                    self.process_group.recv([payload], 0, 0).wait(self.timeout)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self._deliver((key, first_block_index), payload)
        except Exception as error:  # noqa: BLE001 - any failure breaks the pair
            self._break(f"receive failed: {error}")

    def _deliver(self, key: tuple[int, int], payload: torch.Tensor) -> None:
        with self._lock:
            if key[0] in self._forgotten:
                return
            future = self._waiting.pop(key, None)
            if future is None:
                self._arrived[key] = payload
                return
        _settle(future, payload)

    # ------------------------------------------------------------------------ both

    def close(self) -> None:
        """Rank 0: send what is queued, then a close frame (the receiver ends cleanly).
        Rank 1: stop delivering; the receive thread ends at the next frame. Idempotent.
        Waiters and later calls get `SourceLostError`."""
        if self.rank == 0 and not self.broken:
            self._outbox.put(([_CLOSE, 0, 0, 0], None, None))
            self._thread.join(self.timeout.total_seconds())
        self._break("closed")
        self._fail_outbox()  # runs queued after the close frame will never go out

    def _break(self, reason: str) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = reason
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            _settle(future, error=SourceLostError(f"pair {self.group_name}: {reason}"))

    def _require_rank(self, rank: int) -> None:
        if self.rank != rank:
            role = "send" if rank == 0 else "receive"
            raise RuntimeError(f"pair {self.group_name}: rank {self.rank} cannot {role} runs")


def _settle(future: concurrent.futures.Future, result: object = None,
            error: BaseException | None = None) -> None:
    """Complete a future unless its waiter gave up (cancelled by a deadline) meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
