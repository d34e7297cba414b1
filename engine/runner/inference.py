"""`inference_mode`: `torch.inference_mode()` around a per-step function, entered only when the
caller is not inside one already.

Why: entering inference mode costs more than the rest of a small decode step's Python (a few
microseconds on a quiet host, tens on a busy one: measured with `bench/host_step.py`), and the
runner and the sampler each entered it once per step. `Engine.step` now enters it once, and the
runner and sampler inside it take it as given; called on their own, they still enter it.
The guard entered is torch's C++ one (`torch._C._InferenceMode`, which `torch.inference_mode`
enters after two Python frames of its own): the same mode at ~40% of the cost (~2.5 against ~6 µs).
"""

from __future__ import annotations

import functools

import torch

_GUARD = getattr(torch._C, "_InferenceMode", torch.inference_mode)   # (the public one if torch drops it)


def inference_mode(fn):
    """Decorator: run `fn` in inference mode, entering it only if it is not on already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with _GUARD(True):
            return fn(*args, **kwargs)
    return run
