"""Suite-wide settings: built-in presets go to a cache inside the checkout, never $HOME."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CBSERVE_CACHE_DIR", str(ROOT / ".cache"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
