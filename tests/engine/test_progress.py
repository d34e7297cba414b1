"""Progress bars draw on a terminal and stay out of logs, pipes and files.

The end-to-end cases run a real process that generates the tiny preset's weights, loads them and
generates with a bar label, once with stderr on a pseudo-terminal and once on a pipe.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from engine.progress import on_terminal, progress, stage

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
from engine.engine import Engine, EngineConfig
from engine.config import CacheConfig
from engine.sampling.params import SamplingParams
engine = Engine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64)))
engine.generate(["a", "b", "c"], SamplingParams(max_tokens=2), progress_desc="bench run")
print("done", flush=True)
"""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_draw_on_a_terminal_only():
    for stream, draws in ((io.StringIO(), False), (FakeTerminal(), True)):
        for _ in progress(range(3), desc="loading weights", stream=stream):
            pass
        with stage("profiling KV cache", stream=stream):
            pass
        text = stream.getvalue()
        assert ("loading weights" in text and "profiling KV cache" in text) == draws, text
        assert (text != "") == draws
    quiet = FakeTerminal()
    for _ in progress(range(3), desc="x", stream=quiet, quiet=True):
        pass
    assert quiet.getvalue() == ""
    assert not on_terminal(io.StringIO()) and on_terminal(FakeTerminal())


def test_stage_closes_its_bar_when_the_step_fails():
    stream = FakeTerminal()
    with pytest.raises(RuntimeError):
        with stage("profiling KV cache", stream=stream):
            raise RuntimeError("out of memory")
    assert "profiling KV cache" in stream.getvalue()


def _run(tmp_path: Path, on_tty: bool) -> tuple[str, str]:
    """(stdout, stderr) of SCRIPT with a fresh preset cache; stderr on a pty or a pipe."""
    env = dict(os.environ, CBSERVE_CACHE_DIR=str(tmp_path / ("tty" if on_tty else "pipe")),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if not on_tty:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    master, slave = pty.openpty()
    # A new pty is 0x0, and tqdm draws nothing in zero columns; a real terminal has a size.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:          # EIO: the last writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=slave,
                          text=True, timeout=300)
    os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    return proc.stdout, err


def test_weights_load_and_generate_show_progress_on_a_terminal(tmp_path):
    out, err = _run(tmp_path, on_tty=True)
    assert out.strip() == "done"
    from engine.presets import FORMAT_VERSION

    for label in ("generating tiny weights", f"loading tiny-v{FORMAT_VERSION}", "bench run", "3/3"):
        assert label in err, err


def test_nothing_is_drawn_when_stderr_is_not_a_terminal(tmp_path):
    out, err = _run(tmp_path, on_tty=False)
    assert out.strip() == "done"
    assert "\r" not in err and "generating" not in err and "bench run" not in err and "tensor" not in err, err
