"""Backend choice for the public kernel functions.

Triton runs when the tensors live on CUDA (and triton imports); the pure-torch reference runs
everywhere else. ``CBSERVE_KERNEL_BACKEND=torch|triton`` forces one; the tests force ``triton``
together with ``TRITON_INTERPRET=1`` so the Triton kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

ENV_VAR = "CBSERVE_KERNEL_BACKEND"
TORCH = "torch"
TRITON = "triton"
_CHOICES = (TORCH, TRITON)


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` succeeds (checked once per process)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - any import failure means "no triton"
        return False
    return True


def select_backend(tensor: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for a call whose main input is ``tensor``.

    The environment variable is read on every call (one dict lookup) so tests and tools can
    switch backends without re-importing the package.
    """
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in _CHOICES:
            raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {_CHOICES}")
        if forced == TRITON and not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported")
        return forced
    if tensor.is_cuda and triton_available():
        return TRITON
    return TORCH


def triton_module(name: str) -> ModuleType:
    """Import ``kernels.<name>`` lazily, so importing ``kernels`` never needs triton."""
    return importlib.import_module(f"kernels.{name}")
