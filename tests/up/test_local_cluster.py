"""LocalCluster's process handling against stand-in children (tests/up/fake_child.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from cbserve.cluster_spec import ClusterSpec
from cbserve.local_cluster import ClusterError, LocalCluster
from cbserve.readiness import grpc_serving, http_ready

FAKE = [sys.executable, str(Path(__file__).with_name("fake_child.py"))]


def cluster(spec: ClusterSpec, lines: list[str] | None = None, **kwargs) -> LocalCluster:
    return LocalCluster(spec, sink=lines.append if lines is not None else None, command=FAKE, **kwargs)


def test_starts_pods_and_router_and_stops_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_RECORD_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_READY_DELAY", "0.5")
    lines: list[str] = []
    spec = ClusterSpec(num_prefill=2, num_decode=1, port=0, threads_per_pod=1, policy="round_robin",
                       max_num_seqs=8, prefix_caching=False, drain_seconds=2)
    with cluster(spec, lines, log_dir=tmp_path / "logs") as c:
        assert [p.name for p in c.pods] == ["prefill-0", "prefill-1", "decode-0"]
        assert len({p.address for p in c.pods} | {p.metrics_url for p in c.pods}) == 6
        assert all(grpc_serving(p.address) for p in c.pods)
        assert http_ready(c.url + "/ready")
        assert c.base_url == c.url + "/v1"
        # The router finds the pods in a file it re-reads (`add_pod`/`remove_pod` rewrite it).
        listed = json.loads(c.pods_file.read_text())
        assert listed == {"prefill": [p.address for p in c.pods[:2]], "decode": [c.pods[2].address]}
        procs = c.processes
    assert all(not p.running for p in procs.values())
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    assert "[decode-0] decode-0 ready" in lines and "[router] router drained" in lines
    assert (tmp_path / "logs" / "prefill-1.log").read_text().splitlines()[-1] == "prefill-1 drained"

    router = json.loads((tmp_path / "router.json").read_text())
    argv = router["argv"]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--discovery") + 1] == "file" and "--listen-fd" in argv
    pod = json.loads((tmp_path / "prefill-0.json").read_text())
    assert pod["threads"] == "1"
    assert pod["argv"][0] == "prefill" and "--no-prefix-caching" in pod["argv"]
    assert pod["argv"][pod["argv"].index("--max-num-seqs") + 1] == "8"


def test_colocated_engines_are_decode_pods_with_colocated_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_RECORD_DIR", str(tmp_path))
    with cluster(ClusterSpec(num_colocated=2, port=0, drain_seconds=1)) as c:
        assert [p.role for p in c.pods] == ["colocated", "colocated"]
        assert json.loads(c.pods_file.read_text()) == {"colocated": [p.address for p in c.pods]}
    pod = json.loads((tmp_path / "colocated-1.json").read_text())["argv"]
    assert pod[0] == "decode" and "--colocated" in pod


def test_child_dying_during_startup_fails_with_its_log_tail(monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "decode-0")
    c = cluster(ClusterSpec(port=0, drain_seconds=1))
    with pytest.raises(ClusterError, match=r"decode-0 exited with code 3 during startup(.|\n)*cannot load model"):
        c.start()
    assert all(not p.running for p in c.processes.values())


def test_startup_timeout_names_the_pod_that_is_not_ready(monkeypatch):
    monkeypatch.setenv("FAKE_READY_DELAY", "30")
    c = cluster(ClusterSpec(port=0, startup_timeout=1.5, drain_seconds=1))
    with pytest.raises(ClusterError, match="not ready after 2s: prefill-0, decode-0"):
        c.start()
    assert all(not p.running for p in c.processes.values())


def test_straggler_is_killed_after_the_grace_period(monkeypatch):
    monkeypatch.setenv("FAKE_IGNORE_SIGTERM", "decode-0")
    c = cluster(ClusterSpec(port=0, drain_seconds=1)).start()
    started = time.monotonic()
    assert c.stop(grace_seconds=1.0) == ["decode-0"]
    assert time.monotonic() - started < 5
    assert c.processes["decode-0"].returncode == -9
    assert c.processes["prefill-0"].returncode == 0


def test_check_alive_reports_a_pod_that_died(monkeypatch):
    with cluster(ClusterSpec(port=0, drain_seconds=1)) as c:
        c.check_alive()
        c.processes["prefill-0"].send(9)
        c.processes["prefill-0"].wait(5)
        with pytest.raises(ClusterError, match="prefill-0 exited with code -9"):
            c.check_alive()


def test_busy_router_port_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        c = cluster(ClusterSpec(port=s.getsockname()[1]))
        with pytest.raises(ClusterError, match="is not free"):
            c.start()
        assert c.processes == {}


@pytest.mark.parametrize("kwargs, message", [
    ({"num_prefill": 0}, "at least 1 prefill"),
    ({"policy": "random"}, "policy must be"),
    ({"kv_transport": "rdma"}, "kv_transport"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"port": 70000}, "port"),
])
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**kwargs)


@pytest.mark.parametrize("given", ["environment", "spec"])
def test_only_the_router_gets_the_api_key(tmp_path, monkeypatch, given):
    """Pods never check the key, so they never see it (issue 11, case 10: `cbserve up` passed its
    whole environment, key included, to every pod). The key is never on a command line."""
    monkeypatch.setenv("FAKE_RECORD_DIR", str(tmp_path))
    if given == "environment":
        monkeypatch.setenv("CBSERVE_API_KEY", "s3cret")
        spec = ClusterSpec(port=0, drain_seconds=1)
    else:
        monkeypatch.delenv("CBSERVE_API_KEY", raising=False)
        spec = ClusterSpec(port=0, drain_seconds=1, api_key="s3cret")
    assert "s3cret" not in repr(spec)
    with cluster(spec):
        pass
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("router", "prefill-0", "decode-0")}
    assert records["router"]["api_key"] == "s3cret"
    assert records["prefill-0"]["api_key"] is None and records["decode-0"]["api_key"] is None
    assert all("s3cret" not in " ".join(r["argv"]) for r in records.values())


def test_pods_added_and_removed_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_READY_DELAY", "0.3")
    lines: list[str] = []
    with cluster(ClusterSpec(port=0, drain_seconds=1), lines) as c:
        c.supervise_in_background(interval=0.1)
        added = c.add_pod("decode")
        assert added.name == "decode-1" and grpc_serving(added.address)
        assert json.loads(c.pods_file.read_text())["decode"] == [c.pods[1].address, added.address]
        assert c.remove_pod("decode-0") is False          # drained on SIGTERM, not killed
        assert [p.name for p in c.pods] == ["prefill-0", "decode-1"]
        assert json.loads(c.pods_file.read_text())["decode"] == [added.address]
        time.sleep(0.5)
        assert "decode-0" not in c.processes and c.restarts("decode-0") == 0   # retired: not restarted
        assert c.add_pod("decode").name == "decode-2"     # names are never reused
        with pytest.raises(ClusterError, match="not colocated"):
            c.add_pod("colocated")
        assert http_ready(c.url + "/ready")
    assert "[decode-0] decode-0 drained" in lines


def test_a_pod_added_from_a_thread_outlives_the_thread(tmp_path, monkeypatch):
    # PR_SET_PDEATHSIG follows the thread that forked the child: a pod added from a `cbserve scale`
    # handler thread used to get SIGTERM as soon as that thread ended.
    import threading

    monkeypatch.setenv("FAKE_READY_DELAY", "0.1")
    with cluster(ClusterSpec(port=0, drain_seconds=1)) as c:
        added = []
        thread = threading.Thread(target=lambda: added.append(c.add_pod("decode")))
        thread.start()
        thread.join()
        time.sleep(1.0)
        assert c.processes[added[0].name].running and grpc_serving(added[0].address)
