"""Kernel tests run the Triton kernels in Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before ``kernels``'
Triton modules are imported (they import lazily, on first use). It is process-wide, so it is set
only when nobody set it and no GPU is present: on a CUDA machine the same tests run the compiled
kernels on CUDA tensors instead, and the rest of the suite never sees the interpreter.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# pytest puts tests/ on sys.path (rootdir conftest, no __init__.py), where tests/kernels would
# shadow the real package as a namespace package unless the checkout root is importable too.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def device() -> torch.device:
    """Where Triton-backed tests put their tensors: CPU under the interpreter, else CUDA."""
    if INTERPRETED:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or CUDA")


@contextlib.contextmanager
def forced_backend(name: str | None) -> Iterator[None]:
    """Force a kernel backend (None: choose by device) inside the block; the backend module reads
    CBSERVE_KERNEL_BACKEND once, so tests switch it through ``set_backend``, not the environment."""
    from kernels import backend

    previous = backend.set_backend(name)
    try:
        yield
    finally:
        backend.set_backend(previous)


@pytest.fixture
def triton_backend(device: torch.device) -> Iterator[torch.device]:
    """Force the Triton backend for one test; yields the device to build tensors on."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    with forced_backend("triton"):
        yield device


@pytest.fixture
def torch_backend() -> Iterator[None]:
    """Force the torch reference backend for one test."""
    with forced_backend("torch"):
        yield


@pytest.fixture
def auto_backend() -> Iterator[None]:
    """No forced backend for one test: the choice follows the tensors' device."""
    with forced_backend(None):
        yield
