"""`cbserve scale` changes a running cluster's pod counts over its control socket (stand-in
children: no model)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from cbserve.cli import main
from cbserve.cluster_spec import ClusterSpec
from cbserve.control import ControlServer, send
from cbserve.local_cluster import LocalCluster

FAKE = [sys.executable, str(Path(__file__).with_name("fake_child.py"))]


@pytest.fixture
def running(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_READY_DELAY", "0.2")
    cluster = LocalCluster(ClusterSpec(port=0, drain_seconds=1), command=FAKE).start()
    control = ControlServer(cluster, tmp_path / "ctl" / "control.sock").start()
    try:
        yield cluster, control
    finally:
        control.close()
        cluster.stop()


def test_scale_up_and_down_and_status(running, capsys):
    cluster, control = running
    assert stat.S_IMODE(os.stat(control.path.parent).st_mode) == 0o700   # only its user gets in
    assert main(["scale", "--socket", str(control.path), "--decode", "3"]) == 0
    assert [p.name for p in cluster.pods] == ["prefill-0", "decode-0", "decode-1", "decode-2"]
    assert json.loads(cluster.pods_file.read_text())["decode"] == [p.address for p in cluster.pods[1:]]
    assert main(["scale", "--socket", str(control.path), "--decode", "1", "--prefill", "2"]) == 0
    assert [p.name for p in cluster.pods] == ["prefill-0", "decode-0", "prefill-1"]   # newest retired first
    capsys.readouterr()
    assert main(["scale", "--socket", str(control.path)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["prefill-0", "decode-0", "prefill-1"]


def test_bad_requests_get_a_reason(running, capsys):
    cluster, control = running
    assert send(control.path, {"scale": {"decode": 0}}) == {"error": "a cluster needs at least one decode pod"}
    assert "unknown command" in send(control.path, {"reboot": {}})["error"]
    assert "not colocated" in send(control.path, {"scale": {"colocated": 2}})["error"]
    assert main(["scale", "--socket", str(control.path.with_name("nope.sock")), "--decode", "2"]) == 1
    assert "no `cbserve up` answers" in capsys.readouterr().err
