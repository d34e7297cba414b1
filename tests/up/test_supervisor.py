"""Supervision against stand-in children (tests/up/fake_child.py): a dead child comes back with the
same command line (so the same address), with backoff; the others are left alone."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path


from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import LocalCluster
from cbserve.processes import ManagedProcess, child_env
from cbserve.readiness import grpc_serving
from cbserve.supervisor import MAX_BACKOFF_SECONDS, STABLE_SECONDS, Supervisor, backoff_seconds

FAKE = [sys.executable, str(Path(__file__).with_name("fake_child.py"))]


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_seconds(n) for n in (1, 2, 3, 4, 5, 6, 7, 20)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert MAX_BACKOFF_SECONDS == 30


def test_killed_pod_is_restarted_at_its_address_and_the_rest_keep_running():
    lines: list[str] = []
    spec = ClusterSpec(num_prefill=1, num_decode=2, port=0, threads_per_pod=1, drain_seconds=2)
    with LocalCluster(spec, sink=lines.append, command=FAKE) as cluster:
        cluster.supervise_in_background(interval=0.1)
        procs = cluster.processes
        pids = {name: p.pid for name, p in procs.items()}
        decode = next(p for p in cluster.pods if p.name == "decode-0")
        procs["decode-0"].send(signal.SIGKILL)
        _until(lambda: cluster.restarts("decode-0") == 1 and grpc_serving(decode.address), 30, "decode-0 back")
        assert procs["decode-0"].pid != pids["decode-0"]
        assert {n: p.pid for n, p in procs.items() if n != "decode-0"} == {
            n: pid for n, pid in pids.items() if n != "decode-0"}
        assert any("decode-0 exited with code -9; restarting it in 1s" in line for line in lines), lines
        procs["router"].send(signal.SIGKILL)       # the router too
        _until(lambda: cluster.restarts("router") == 1 and procs["router"].running, 30, "router back")
        procs = cluster.processes
    assert all(not p.running for p in procs.values())


def test_crash_loop_backs_off_and_a_stable_run_resets_it(tmp_path):
    proc = ManagedProcess("crasher", [sys.executable, "-c", "import sys; sys.exit(7)"], child_env(None))
    proc.start()
    proc.wait(10)
    supervisor = Supervisor({"crasher": proc})
    t = time.monotonic()
    delays = []
    for _ in range(4):
        assert supervisor.poll(t) == []                   # exit noticed: restart scheduled
        restart_at = supervisor._children["crasher"].restart_at
        delays.append(round(restart_at - t))
        assert supervisor.poll(restart_at) == ["crasher"]
        proc.wait(10)
        t = restart_at + 0.1
    assert delays == [1, 2, 4, 8]
    supervisor.poll(t + STABLE_SECONDS)                    # it had run long enough: back to 1 s
    assert round(supervisor._children["crasher"].restart_at - (t + STABLE_SECONDS)) == 1
