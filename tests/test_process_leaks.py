"""The leak check's mechanism (tests/process_leaks.py): a child marked in its environment is found
wherever it runs, and stopped; the session-finish hook in tests/conftest.py fails a run that
leaves a cbserve process behind (checked by hand: a test that leaves
`python -c 'sleep' cbserve router` running makes pytest exit 1 and names the process)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from tests.process_leaks import SESSION_ENV, is_cbserve, marked, stop


def test_a_marked_grandchild_is_found_and_stopped_even_ignoring_sigterm(tmp_path):
    value = uuid.uuid4().hex
    env = {**os.environ, "LEAK_PROBE": value}
    ready = tmp_path / "ignoring"
    # The child starts a grandchild in its own session and exits: the grandchild is reparented.
    grandchild = (f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    script = ("import pathlib, subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {grandchild!r}, 'cbserve', 'decode'], start_new_session=True)\n"
              f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.05)\n")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    (orphan,) = marked("LEAK_PROBE", value)
    assert is_cbserve(orphan) and "cbserve decode" in orphan.command
    assert stop("LEAK_PROBE", value, grace_seconds=1.0) == [orphan]     # it needed SIGKILL
    assert marked("LEAK_PROBE", value) == []


def test_this_session_is_marked():
    assert len(os.environ[SESSION_ENV]) == 32
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in {p.pid for p in marked(SESSION_ENV, os.environ[SESSION_ENV])}
    finally:
        child.kill()
        child.wait()
