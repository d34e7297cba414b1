"""`cbserve up`'s router socket, bound before the command's imports: a client that connects the
moment `cbserve up` is launched waits in the listen backlog instead of being refused while Python
loads gRPC, httpx and the rest (seconds on a loaded machine; past the `openai` client's retries).

`bind_for_up(argv)` runs first thing in `cbserve.cli.main`; it binds only for `up` and only a
fixed port, and never fails: a port it cannot take is left for `LocalCluster` to report.
`take(host, port)` hands the socket to whoever starts the cluster with that address.
"""

from __future__ import annotations

import argparse
import socket

_bound: dict[tuple[str, int], socket.socket] = {}


def bind_for_up(argv: list[str]) -> None:
    """Bind `cbserve up`'s --host/--port now, if `argv` is an `up` command with a fixed port."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--log-level")
    parser.add_argument("command", nargs="?")
    known, rest = parser.parse_known_args(argv)
    if known.command != "up":
        return
    up = argparse.ArgumentParser(add_help=False)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    try:
        args, _ = up.parse_known_args(rest)
    except SystemExit:          # a malformed --port: the real parser says so
        return
    if args.port == 0:
        return
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        _bound[(args.host, args.port)] = socket.create_server((args.host, args.port), family=family, backlog=1024)
    except OSError:
        pass


def take(host: str, port: int) -> socket.socket | None:
    """The socket bound early for `host:port`, once (None if there is none)."""
    return _bound.pop((host, port), None)
