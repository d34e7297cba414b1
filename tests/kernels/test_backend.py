"""Backend choice: CPU -> torch, env override, and a package that imports without triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import backend

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_tensors_use_torch(monkeypatch) -> None:
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.select_backend(torch.zeros(1)) == backend.TORCH


@pytest.mark.parametrize("value, expected", [("torch", "torch"), ("TRITON", "triton"), (" torch ", "torch")])
def test_env_forces_backend(monkeypatch, value, expected) -> None:
    monkeypatch.setenv(backend.ENV_VAR, value)
    if expected == "triton" and not backend.triton_available():
        pytest.skip("triton is not installed")
    assert backend.select_backend(torch.zeros(1)) == expected


def test_env_rejects_unknown_backend(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="expected one of"):
        backend.select_backend(torch.zeros(1))


def test_forcing_triton_without_triton_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        backend.select_backend(torch.zeros(1))


def test_package_imports_and_runs_without_triton() -> None:
    # A fresh interpreter where `import triton` fails: kernels must import and run on the reference.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "x = torch.randn(2, 8)\n"
        "out = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert out.shape == (2, 8) and 'kernels.norm_triton' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != backend.ENV_VAR}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
