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
