"""Processes that import `cbserve` or `engine` before torch get libgomp's passive wait unless the
environment chose a policy (engine/__init__.py): spinning idle threads took the cores from the
working ones whenever threads outnumbered cores, and a tiny model's step ran ~20x slower."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = "import {module}, os, sys; assert 'torch' not in sys.modules; print(os.environ['OMP_WAIT_POLICY'])"


def _policy(module: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(module=module)], env=environ, check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_cbserve_and_engine_set_passive_waiting_before_torch_loads():
    assert _policy("cbserve") == _policy("engine") == "PASSIVE"


def test_an_operators_policy_is_kept():
    assert _policy("cbserve", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
