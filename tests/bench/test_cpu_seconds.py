"""cbserve/goodput/cpu.py: a process's CPU seconds include its children's (a pod's engine core)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cbserve.goodput import cpu

# A parent that only waits on a child that burns the CPU, as a pod's server waits on its engine core.
BUSY_CHILD = ("import subprocess, sys; "
              "subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
              "while time.process_time() - t < 0.6: pass\\ntime.sleep(30)'])")


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_a_process_is_charged_its_childrens_cpu():
    parent = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        deadline = time.monotonic() + 20
        while True:
            children = cpu._children(parent.pid)
            own = cpu._own_cpu_seconds(parent.pid)
            total = cpu._proc_cpu_seconds(parent.pid)
            if children and total - own >= 0.5:
                break
            assert time.monotonic() < deadline, (children, own, total)
            time.sleep(0.1)
        assert own < 0.5 < total
    finally:
        for child in cpu._children(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_a_pods_cpu_splits_into_its_server_its_engine_thread_and_the_rest():
    """The busiest thread of a pod's descendants is its engine thread; the server's own threads
    and the child's others are apart (`cpu.thread_split`)."""
    class Cluster:       # what `cluster_thread_cpu_seconds` reads of a LocalCluster
        processes = {}
    before = {"pod": {"server": {}, "core": {}}}
    parent = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    Cluster.processes = {"pod": parent}
    try:
        deadline = time.monotonic() + 20
        while True:
            split = cpu.thread_split(cpu.cluster_thread_cpu_seconds(Cluster), before)["pod"]
            if split["engine"] >= 0.5:
                break
            assert time.monotonic() < deadline, split
            time.sleep(0.1)
        assert split["server"] < 0.5 and split["core_other"] < 0.1
    finally:
        for child in cpu._children(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_thread_split_takes_the_busiest_core_thread_as_the_engine_and_counts_new_threads_from_zero():
    before = {"pod": {"server": {1: 1.0, 2: 0.5}, "core": {10: 2.0, 11: 0.1}}}
    after = {"pod": {"server": {1: 1.5, 2: 0.5}, "core": {10: 5.0, 11: 0.3, 12: 0.2}},
             "router": {"server": {3: 0.7}, "core": {}}}
    split = cpu.thread_split(after, before)
    assert split["pod"] == pytest.approx({"server": 0.5, "engine": 3.0, "core_other": 0.4})
    assert split["router"] == pytest.approx({"server": 0.7, "engine": 0.0, "core_other": 0.0})
