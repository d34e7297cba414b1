"""`cbserve up` binds its router port first thing (cbserve/early_listen.py): a connection made
before the cluster starts waits in the backlog and is served by the router later."""

from __future__ import annotations

import socket

from cbserve import early_listen
from cbserve.local_cluster import free_ports


def test_only_up_with_a_fixed_port_binds_early():
    (port,) = free_ports(1)
    early_listen.bind_for_up(["--log-level", "DEBUG", "router", "--port", str(port)])
    early_listen.bind_for_up(["up", "--port", "0"])
    early_listen.bind_for_up(["up", "--port", "not-a-number"])
    assert early_listen.take("127.0.0.1", port) is None and early_listen.take("127.0.0.1", 0) is None
    early_listen.bind_for_up(["--log-level", "INFO", "up", "--decode", "2", "--port", str(port)])
    sock = early_listen.take("127.0.0.1", port)
    try:
        assert sock is not None and sock.getsockname() == ("127.0.0.1", port)
        assert early_listen.take("127.0.0.1", port) is None          # handed over once
        client = socket.create_connection(("127.0.0.1", port), timeout=5)   # accepted by the kernel
        conn, _ = sock.accept()                                       # ... and served once someone accepts
        client.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        conn.close()
        client.close()
    finally:
        if sock is not None:
            sock.close()


def test_a_taken_port_is_left_for_the_real_error():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        early_listen.bind_for_up(["up", "--port", str(port)])
        assert early_listen.take("127.0.0.1", port) is None
