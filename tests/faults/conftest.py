"""Fixtures of the fault suite: one prefill + one decode pod shared by the tests that leave them
healthy (each such test ends by checking both are back at their idle KV baseline)."""

from __future__ import annotations

import pytest

from tests.faults.cluster import PROXY_PORT, start_pods, wait_idle

# Short enough that a black-holed pull's held KV is released within a test, long enough that a
# pull on a loaded machine is never late.
PAIR_KV_TTL_SECONDS = 8


@pytest.fixture(scope="session")
def pair():
    """(prefill, decode) pods over gRPC KV transfer; idle at the start of every test that uses them."""
    # The KV-path proxy test pulls through a proxy on PROXY_PORT: the router would vouch for that
    # address, so the prefill pod advertises it too (a pod behind a proxy has two addresses).
    prefill, decode = start_pods(("prefill", "--kv-ttl-seconds", str(PAIR_KV_TTL_SECONDS),
                                  "--advertise-address", f"127.0.0.1:{PROXY_PORT}"), ("decode",))
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture
def idle_pair(pair):
    wait_idle(list(pair))
    return pair
