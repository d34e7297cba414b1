"""A loopback TCP proxy that injects network faults between two real processes.

    with FaultProxy("127.0.0.1", prefill.port) as proxy:   # listens on proxy.address
        proxy.set_mode("delay", delay_s=0.3)   # every chunk waits 0.3 s, order kept
        proxy.set_mode("drop")                 # a black hole: bytes are read and discarded
        proxy.set_mode("reset")                # every connection (open or new) gets a TCP RST
        proxy.heal()                           # forward again; black-holed connections are reset

The proxy runs its own asyncio loop in a thread, so blocking test code and grpc clients can use
it. "drop" models a partition: nothing arrives and nobody is told, so only keepalives and
deadlines notice. A connection that lost bytes cannot carry HTTP/2 any more, so `heal` resets
those (as a middlebox that lost its state would) and new connections forward cleanly.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass, field

MODES = ("pass", "delay", "drop", "reset")


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    lost_bytes: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target_host:target_port`, with the fault of `mode`."""

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self.mode = "pass"
        self.delay_s = 0.0
        self.num_connections = 0      # accepted so far
        self.num_resets = 0           # connections this proxy reset
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set_mode(self, mode: str, delay_s: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._call(self._set_mode(mode, delay_s))

    def heal(self) -> None:
        self.set_mode("pass")

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ the loop's side
    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            self._drop_conn(conn, reset=True)

    async def _set_mode(self, mode: str, delay_s: float) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == "reset":
            for conn in list(self._conns):
                self._drop_conn(conn, reset=True)
        elif mode == "pass":
            for conn in [c for c in self._conns if c.lost_bytes]:
                self._drop_conn(conn, reset=True)

    def _drop_conn(self, conn: _Conn, reset: bool) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if reset:
            self.num_resets += 1
            _rst(conn.client)
            _rst(conn.upstream)
        else:
            conn.client.close()
            if conn.upstream is not None:
                conn.upstream.close()
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        conn = _Conn(writer)
        self._conns.add(conn)
        if self.mode == "reset":
            self._drop_conn(conn, reset=True)
            return
        if self.mode == "drop":   # a black hole from the first byte: never reach the target
            conn.lost_bytes = True
            conn.tasks.append(asyncio.current_task())
            await self._pump(reader, None, conn)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._drop_conn(conn, reset=True)
            return
        conn.upstream = up_writer
        conn.tasks.append(asyncio.current_task())
        other = asyncio.ensure_future(self._pump(up_reader, writer, conn))
        conn.tasks.append(other)
        await self._pump(reader, up_writer, conn)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                    conn: _Conn) -> None:
        """One direction of one connection, chunk by chunk, under the current mode."""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if self.mode == "reset":
                    self._drop_conn(conn, reset=True)
                    return
                if self.mode == "delay" and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.mode == "drop" or writer is None:
                    conn.lost_bytes = True
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            if conn in self._conns and not (self.mode == "drop" or conn.lost_bytes):
                self._drop_conn(conn, reset=False)
