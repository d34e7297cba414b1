"""Backend choice for the public kernel functions.

Triton runs when the tensors live on CUDA (and triton imports); the pure-torch reference runs
everywhere else. ``CBSERVE_KERNEL_BACKEND=torch|triton`` forces one; the tests force ``triton``
together with ``TRITON_INTERPRET=1`` so the Triton kernels run on CPU tensors.

Dispatch runs ~60 times per model step, so nothing here touches ``os.environ`` or the import
system per call: the environment variable is read once, on the first call (``refresh()`` reads it
again, ``set_backend()`` overrides it in-process), and each Triton launcher is imported once and
kept in a dict (``triton_fn``).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

ENV_VAR = "CBSERVE_KERNEL_BACKEND"
TORCH = "torch"
TRITON = "triton"
_CHOICES = (TORCH, TRITON)

_UNSET = object()
# The forced backend: TORCH, TRITON, None (choose by device) or _UNSET (environment not read yet).
_forced: object = _UNSET
_launchers: dict[tuple[str, str], Callable] = {}


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` succeeds (checked once per process)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - any import failure means "no triton"
        return False
    return True


def _validate(name: str | None) -> str | None:
    if name is None:
        return None
    name = name.strip().lower()
    if not name:
        return None
    if name not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={name!r}: expected one of {_CHOICES}")
    if name == TRITON and not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported")
    return name


def refresh() -> str | None:
    """Read ``CBSERVE_KERNEL_BACKEND`` again (tools and tests that change it at runtime call this).

    Returns the forced backend, or None when the choice follows the tensors' device."""
    global _forced
    _forced = _UNSET  # a bad value must not leave the previous setting in place
    _forced = _validate(os.environ.get(ENV_VAR, ""))
    return _forced


def set_backend(name: str | None) -> str | None:
    """Force ``"torch"`` or ``"triton"`` for this process (None: choose by device), overriding the
    environment variable until the next ``refresh()``. Returns the previous forced backend."""
    global _forced
    previous = forced_backend()
    _forced = _validate(name)
    return previous


def forced_backend() -> str | None:
    """The forced backend (reads the environment variable on first use), or None."""
    forced = _forced
    return refresh() if forced is _UNSET else forced  # type: ignore[return-value]


def select_backend(tensor: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for a call whose main input is ``tensor``."""
    forced = _forced
    if forced is _UNSET:
        forced = refresh()
    if forced is not None:
        return forced  # type: ignore[return-value]
    if tensor.is_cuda and triton_available():
        return TRITON
    return TORCH


def use_triton(tensor: torch.Tensor) -> bool:
    """``select_backend(tensor) == "triton"``, as the dispatch in ``kernels`` asks it."""
    forced = _forced
    if forced is _UNSET:
        forced = refresh()
    if forced is not None:
        return forced == TRITON
    return tensor.is_cuda and triton_available()


def triton_fn(module: str, name: str) -> Callable:
    """``kernels.<module>.<name>``, imported on first use (so importing ``kernels`` never needs
    triton) and then served from a dict."""
    fn = _launchers.get((module, name))
    if fn is None:
        fn = getattr(importlib.import_module(f"kernels.{module}"), name)
        _launchers[(module, name)] = fn
    return fn
