"""Suite-wide settings: built-in presets go to a cache inside the checkout, never $HOME; Triton's
interpreter on machines without CUDA.

TRITON_INTERPRET is read when triton is first imported (its own `triton.language` helpers are
decorated then), so it is set here, before any test module is collected: a module that imports
triton while being collected (e.g. `pytest.importorskip("triton")` in tests/engine) would
otherwise fix triton in compiled mode for the whole process, and every interpreted kernel test
collected after it would fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
Without CUDA the rest of the suite runs the torch kernels, so the interpreter changes nothing there.
"""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CBSERVE_CACHE_DIR", str(ROOT / ".cache"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    # The image tests go last: CI builds the image in the background while the rest runs.
    items.sort(key=lambda item: Path(str(item.path)).is_relative_to(ROOT / "tests" / "image"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
