"""Issue 11 case 7: under CPU load, `test_disaggregated_equals_colocated[seeded-nccl]` saw a decode
pod emit a first token that was not its prefill pod's, with `local_prefill` false.

The cause: gRPC servers set SO_REUSEPORT by default, so a pod told to listen on a port another pod
already served bound it as well, and the kernel split new connections between the two processes.
Test pods take free ports with bind-release-rebind (`podproc.free_port`); a loaded machine
widens the window between release and the child's bind, so two pods started at about the same
time (by concurrent test sessions, which use the same request ids) could land on one port. A
decode pod's `PullKV` then reached the *other* process, which held a request of the same id and
answered with its KV and its first token. Pods now listen exclusively: the second one fails to
start with "Address already in use" (podproc then respawns it elsewhere).

The test forces the collision that load made likely: a second prefill pod is started on the first
one's port. The port is given to it, not raced for, so the test needs no load to make the collision
happen (it ran beside busy loops on every core once, which only slowed the suite's other tests).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from tests.pods.podproc import AUTH, Pod, disaggregated, run, sampling
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SEEDED = dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=6)


def _pod_ids(address: str, connections: int = 16) -> set[str]:
    """The pod ids that answer `Handshake` over `connections` fresh TCP connections."""
    ids = set()
    for _ in range(connections):
        with grpc.insecure_channel(address) as channel:
            ids.add(pb_grpc.PrefillServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=30,
                                                                     metadata=AUTH).pod_id)
    return ids


def _engine_cores(pod_id: str) -> list[int]:
    """Live engine-core processes of the pod with `pod_id` (zombies are dead)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"--engine-core-fd" in args and pod_id.encode() in args and state != "Z":
            found.append(int(pid))
    return found


def test_a_second_pod_cannot_take_a_served_port():
    first, decode = Pod("prefill", "--pod-id", "prefill-first"), Pod("decode")
    second = None
    try:
        first.wait_ready(), decode.wait_ready()
        second = Pod("prefill", "--pod-id", "prefill-second")
        second.kill()
        second.proc.wait(15)
        second._spawn(first.port)   # the port the first pod serves, as a lost free-port race gives it
        deadline = time.monotonic() + 180
        while second.proc.poll() is None and "serving on" not in second.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, second.log_tail()
            time.sleep(0.2)
        # Every connection to the address reaches the pod that owns it ...
        assert _pod_ids(first.address) == {"prefill-first"}
        # ... because the second one could not bind it, and said why.
        assert second.proc.wait(30) != 0
        assert "Address already in use" in second.log_tail(), second.log_tail()
        # Its engine core, started before the bind failed, does not outlive it.
        deadline = time.monotonic() + 15
        while _engine_cores("prefill-second"):
            assert time.monotonic() < deadline, f"orphaned engine cores: {_engine_cores('prefill-second')}"
            time.sleep(0.2)
        # Disaggregated seeded requests: the decode pod's first token is its prefill pod's.
        for i in range(4):
            prompt = [1] + [(31 * i + 7 * k) % 250 + 4 for k in range(40)]
            tokens, messages = run(disaggregated(first, decode, f"exclusive-{i}", prompt, sampling(**SEEDED)))
            assert not messages[0].local_prefill and len(tokens) == SEEDED["max_tokens"]
    finally:
        for pod in (first, decode, second):
            if pod is not None:
                pod.stop()
