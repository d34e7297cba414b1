"""The router never imports torch: it runs on CPU-only nodes with a small image."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_router_does_not_import_torch():
    code = ("import sys, router.app, router.drain, router.discovery.kubernetes, router.policy; "
            "assert 'torch' not in sys.modules, 'router imported torch'; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
