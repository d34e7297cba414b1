"""The router never imports torch: it runs on CPU-only nodes with a small image."""

from __future__ import annotations

import os
import subprocess
import sys

# Starts the app (tokenizer from the `tiny` preset, discovery, load tracking) and serves one
# request-free lifecycle, then checks what got imported.
_SCRIPT = """
import asyncio, sys
import router.app, router.drain, router.flags, router.discovery.kubernetes
from router.app import create_app
from router.config import RouterConfig

async def main():
    app = create_app(RouterConfig(model="tiny", colocated=("127.0.0.1:1",), api_key_env=None))
    async with app.router.lifespan_context(app):
        state = app.state.serving
        assert state.tokenizer.encode("hi"), "tokenizer loaded"
        assert state.max_model_len() == 2048, state.max_model_len()
asyncio.run(main())
assert 'torch' not in sys.modules, 'router imported torch'
assert 'transformers' not in sys.modules, 'router imported transformers'
"""


def test_router_runs_without_importing_torch(tmp_path):
    env = {**os.environ, "CBSERVE_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _SCRIPT], check=True, timeout=120, env=env)
