"""Suite-wide settings: built-in presets go to a cache inside the checkout, never $HOME; Triton's
interpreter on machines without CUDA; no cbserve process outlives the session, and no grpc.aio
channel or server outlives its test's event loop (every test stops what it started).

TRITON_INTERPRET is read when triton is first imported (its own `triton.language` helpers are
decorated then), so it is set here, before any test module is collected: a module that imports
triton while being collected (e.g. `pytest.importorskip("triton")` in tests/engine) would
otherwise fix triton in compiled mode for the whole process, and every interpreted kernel test
collected after it would fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
Without CUDA the rest of the suite runs the torch kernels, so the interpreter changes nothing there.
"""

import importlib.metadata
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

import engine  # noqa: F401 - before torch: libgomp's threads wait passively (engine/__init__.py)
import torch

from tests import grpc_leaks
from tests.process_leaks import SESSION_ENV, is_cbserve, marked, stop

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CBSERVE_CACHE_DIR", str(ROOT / ".cache"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Every process this session starts inherits the mark (tests/process_leaks.py); a fresh one per
# session, so a session never blames another's processes (other developers', or its parent's).
os.environ[SESSION_ENV] = uuid.uuid4().hex
# A process stopped at the very end of a test may take its drain to exit.
LEAK_GRACE_SECONDS = 20.0


grpc_leaks.track()
grpc_leaks.ignore_stale_events()


@pytest.fixture(autouse=True)
def grpc_objects_closed_with_their_loop():
    """Fail the test that leaves a grpc.aio channel or server open after its event loop stopped
    (`tests/grpc_leaks.py`): grpc would deliver its next event to the closed loop, and the
    `Event loop is closed` it raises would fail a later test."""
    yield
    leaked = grpc_leaks.open_on_stopped_loops()
    assert not leaked, f"left open after their event loop stopped: {', '.join(leaked)}"


def pytest_sessionstart(session):
    """Stop before any test when a distribution named `kernels` is installed (Hugging Face's, which
    transformers >= 5.25 requires): its import name is our `kernels/` package, so transformers would
    import ours and every test that builds a reference model would fail on an ImportError."""
    try:
        found = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    pytest.exit(f"a distribution named `kernels` ({found}) is installed, and `import kernels` finds this "
                "project's package: transformers would import ours. Keep transformers < 5.25 (pyproject.toml's "
                "test extra) and `pip uninstall kernels`.", returncode=4)


def pytest_collection_modifyitems(config, items):
    # The image tests go last: CI builds the image in the background while the rest runs. (Putting
    # the files with multi-process tests first as well made the suite 2 min slower: they then all
    # ran beside the image build.)
    items.sort(key=lambda item: Path(str(item.path)).is_relative_to(ROOT / "tests" / "image"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a cbserve process (router, pod, `cbserve up`, engine core, tensor-parallel
    rank, the image's entry point) that this session started is still running; then stop it, so it
    does not outlive the run either."""
    if not Path("/proc/self/environ").exists():
        return
    mark = os.environ[SESSION_ENV]
    deadline = time.monotonic() + LEAK_GRACE_SECONDS
    while (leaked := [p for p in marked(SESSION_ENV, mark) if is_cbserve(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not leaked:
        return
    lines = "\n".join(f"  {p}" for p in leaked)
    message = (f"{len(leaked)} cbserve process(es) outlived the test session (a test did not stop what it "
               f"started); stopping them now:\n{lines}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "leaked processes", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    stop(SESSION_ENV, mark)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
