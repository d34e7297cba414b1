"""Backend choice: CPU -> torch, env override read once (refresh / set_backend to switch), cached
Triton launchers, and a package that imports without triton."""

from __future__ import annotations

import os
import subprocess
import sys
import timeit
from pathlib import Path

import pytest
import torch

from kernels import backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = backend.forced_backend()
    yield
    backend.set_backend(previous)


def test_cpu_tensors_use_torch(monkeypatch) -> None:
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.refresh() is None
    assert backend.select_backend(torch.zeros(1)) == backend.TORCH
    assert not backend.use_triton(torch.zeros(1))


@pytest.mark.parametrize("value, expected", [("torch", "torch"), ("TRITON", "triton"), (" torch ", "torch")])
def test_env_forces_backend(monkeypatch, value, expected) -> None:
    monkeypatch.setenv(backend.ENV_VAR, value)
    if expected == "triton" and not backend.triton_available():
        pytest.skip("triton is not installed")
    assert backend.refresh() == expected
    assert backend.select_backend(torch.zeros(1)) == expected
    assert backend.use_triton(torch.zeros(1)) == (expected == "triton")


def test_env_is_read_once_until_refresh(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    backend.refresh()
    monkeypatch.setenv(backend.ENV_VAR, "bogus")  # not seen: dispatch never reads the environment
    assert backend.select_backend(torch.zeros(1)) == backend.TORCH
    monkeypatch.delenv(backend.ENV_VAR)
    assert backend.refresh() is None


def test_env_is_read_on_first_use(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    monkeypatch.setattr(backend, "_forced", backend._UNSET)  # as in a fresh process
    assert backend.select_backend(torch.zeros(1)) == backend.TORCH


def test_set_backend_overrides_env_and_returns_previous(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    backend.refresh()
    assert backend.set_backend(None) == "torch"
    assert backend.forced_backend() is None
    with pytest.raises(ValueError, match="expected one of"):
        backend.set_backend("cuda")


def test_env_rejects_unknown_backend(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="expected one of"):
        backend.refresh()
    monkeypatch.setattr(backend, "_forced", backend._UNSET)  # a fresh process fails on first use
    with pytest.raises(ValueError, match="expected one of"):
        backend.select_backend(torch.zeros(1))


def test_forcing_triton_without_triton_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        backend.refresh()
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        backend.set_backend("triton")


def test_triton_launchers_are_imported_once(monkeypatch) -> None:
    pytest.importorskip("triton")
    fn = backend.triton_fn("norm_triton", "rms_norm_triton")
    monkeypatch.setattr(backend.importlib, "import_module", lambda name: pytest.fail(f"re-imported {name}"))
    assert backend.triton_fn("norm_triton", "rms_norm_triton") is fn


def test_dispatch_is_cheap() -> None:
    # A loose bound (shared CI machines): the old per-call environment read plus validation cost
    # ~10 us; select_backend is now a global read and a device flag.
    x = torch.zeros(1)
    backend.set_backend(None)
    per_call = min(timeit.repeat(lambda: backend.select_backend(x), number=2000, repeat=5)) / 2000
    assert per_call < 5e-6


def test_package_imports_and_runs_without_triton() -> None:
    # A fresh interpreter where `import triton` fails: kernels must import and run on the reference.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "x = torch.randn(2, 8)\n"
        "out = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert out.shape == (2, 8) and 'kernels.norm_triton' not in sys.modules\n"
        "assert kernels.silu_and_mul(x).shape == (2, 4)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != backend.ENV_VAR}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
